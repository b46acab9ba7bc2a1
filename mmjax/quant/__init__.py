"""Quantized serving: weight-only int8 / int4 and fp8 weights for the decoder's matmuls, fp8 / int8 KV pools.

`weights.py` holds the container (`QuantizedWeight`, the value of an `nnx.Param` in place of its array) and the
fused matmul it runs when `mmjax.model.layers.dense` meets it; `table.py` the int8 tied embedding table (lookup
and logits); `apply.py` converts a model state at load time; `kv.py` names the KV-cache dtypes; `store.py` saves
and loads a pre-quantized state.
"""

from mmjax.quant.apply import SCHEMES, VARIANTS, is_quantized, parse_variant, quantize_state, weight_bytes
from mmjax.quant.table import QuantizedTable, dequantize_table, quantize_table
from mmjax.quant.weights import QuantizedWeight, dequantize, quantize

__all__ = ["SCHEMES", "VARIANTS", "QuantizedTable", "QuantizedWeight", "dequantize", "dequantize_table",
           "is_quantized", "parse_variant", "quantize", "quantize_state", "quantize_table", "weight_bytes"]
