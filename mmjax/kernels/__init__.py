"""Kernels: one folder per op, each with a pure-jnp reference and capability-guarded implementations.

Every op dispatches through `kernels._dispatch.Op`: `impl="auto"` picks the fastest implementation whose
guard accepts the platform, GPU capability, dtype and shapes, and logs once why the others were skipped.
Under a device mesh, trace inside `use_sharding(MeshSharding(mesh, batch_axes, head_axes))` so the custom
kernels run per shard (`_sharding.py`); mmjax's trainer and evaluator enter it with their rules-derived context.
"""

from mmjax.kernels import kv_pages
from mmjax.kernels._sharding import MeshSharding, kv_head_axes, pool_spec, use_sharding
from mmjax.kernels.attention import OP as _ATTENTION
from mmjax.kernels.attention import attention
from mmjax.kernels.bias_gelu import OP as _BIAS_GELU
from mmjax.kernels.bias_gelu import bias_gelu
from mmjax.kernels.cross_entropy import OP as _CROSS_ENTROPY
from mmjax.kernels.cross_entropy import linear_cross_entropy
from mmjax.kernels.norms import OP as _NORM
from mmjax.kernels.norms import layer_norm, rms_norm
from mmjax.kernels.paged_attention import OP as _PAGED_ATTENTION
from mmjax.kernels.paged_attention import paged_attention
from mmjax.kernels.paged_attention import tpu as _paged_tpu  # noqa: F401 - registers the TPU paged impls
from mmjax.kernels.quant_matmul import OP as _QUANT_MATMUL
from mmjax.kernels.quant_matmul import quant_matmul
from mmjax.kernels.ragged_paged_attention import OP as _RAGGED_PAGED_ATTENTION
from mmjax.kernels.ragged_paged_attention import ragged_paged_attention
from mmjax.kernels.swiglu import OP as _SWIGLU
from mmjax.kernels.swiglu import swiglu, swiglu_dense

__all__ = ["kv_pages", "MeshSharding", "use_sharding", "kv_head_axes", "pool_spec", "attention", "paged_attention",
           "ragged_paged_attention",
           "linear_cross_entropy", "rms_norm", "layer_norm", "bias_gelu", "swiglu", "swiglu_dense", "quant_matmul",
           "OPS"]

OPS = {"attention": _ATTENTION, "paged_attention": _PAGED_ATTENTION,
       "ragged_paged_attention": _RAGGED_PAGED_ATTENTION, "cross_entropy": _CROSS_ENTROPY,
       "norm": _NORM, "bias_gelu": _BIAS_GELU, "swiglu": _SWIGLU, "quant_matmul": _QUANT_MATMUL}
