"""Convert a model state's decoder matmuls to `QuantizedWeight`s (serving load time, `serve.quantization`).

Quantized: each decoder layer's `qkv`, `out`, `gate_up` and `down` (the bytes of a decode step); with `lm_head`
(`serve.quantize_lm_head`) also the output matmul, int8 per vocabulary row whatever the scheme: a tied embedding
table as a `table.QuantizedTable` (lookup and logits read its one int8 copy), an untied `lm_head` as a
`QuantizedWeight`. Kept in the param dtype: an untied input embedding (a gather of a few rows per step), norms,
biases, the vision tower and projector (run once per image, not per decoded token).
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from mmjax.errors import ConfigError
from mmjax.model.fp8 import native_fp8
from mmjax.quant.table import QuantizedTable, quantize_table
from mmjax.quant.weights import BITS, GROUP, STORAGE, QuantizedWeight, quantize

log = logging.getLogger(__name__)

SCHEMES = ("none", *STORAGE)
QUANTIZED = (QuantizedWeight, QuantizedTable)  # what a quantized parameter's value is
HEAD_SUFFIX = "+head"  # a variant name's mark for the int8 output matmul (serve.quantize_lm_head)
VARIANTS = (*SCHEMES, *(s + HEAD_SUFFIX for s in SCHEMES))  # names the quality and speed tools take
# per-layer rank and number of leading contracted axes of each decoder matmul's weight
DECODER_MATMULS = {"qkv": (4, 1), "out": (3, 2), "gate_up": (3, 1), "down": (2, 1)}


def parse_variant(name: str) -> tuple[str, bool]:
    """'int8' -> ('int8', False), 'int8+head' -> ('int8', True): (serve.quantization, serve.quantize_lm_head)."""
    scheme = name.removesuffix(HEAD_SUFFIX)
    if scheme not in SCHEMES:
        raise ConfigError(f"quantization variant {name!r}: want a scheme of {', '.join(SCHEMES)}, optionally with "
                          f"{HEAD_SUFFIX!r} for the int8 output matmul")
    return scheme, name.endswith(HEAD_SUFFIX)


def _log_fp8_mode(native: bool, platform: str) -> None:
    if native:
        log.info("serve.quantization=fp8: fp8 x fp8 matmuls (e4m3 weights per channel, activations per token)")
    else:
        log.warning("serve.quantization=fp8: %s has no fp8 matmul; e4m3 weights are upcast to the compute dtype "
                    "at each matmul (weight-only fp8: same weight bytes, no fp8 tensor-core math)", platform)


def param_name(path) -> str:
    """Dotted name of a state path (`decoder.layers.qkv`)."""
    return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def is_quantized(state: Any) -> bool:
    """Whether any parameter of `state` is quantized (a converted or pre-quantized state)."""
    return any(isinstance(x, QUANTIZED) for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, QUANTIZED)))


def quantize_state(state: Any, scheme: str, *, group: int = GROUP, fp8_activations: bool | None = None,
                   lm_head: bool = False) -> Any:
    """`state` (an `nnx.State` of an MLLM or a Decoder) with its decoder matmuls quantized to `scheme`, and with
    `lm_head` its output matmul to int8 (see the module docstring).

    Weights that already are quantized stay as they are (a pre-quantized state). `fp8_activations`
    (fp8 only; default: when the device has fp8 tensor cores) makes the matmuls fp8 x fp8; otherwise fp8 is
    weight-only, logged once. Raises `ConfigError` for an unknown scheme or an int4 weight whose contraction is
    not a multiple of `group`."""
    if scheme not in SCHEMES:
        raise ConfigError(f"serve.quantization={scheme!r} is not one of {', '.join(SCHEMES)}")
    if lm_head:
        state = _quantize_output(state)
    if scheme == "none":
        return state
    if scheme == "fp8":
        if fp8_activations is None:
            fp8_activations = native_fp8()
            _log_fp8_mode(fp8_activations, jax.devices()[0].platform)
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731

    def convert(path, var):
        if not is_var(var) or isinstance(var[...], QUANTIZED):
            return var
        keys = [str(getattr(k, "key", k)) for k in path]
        name = keys[-1] if keys else ""
        if name not in DECODER_MATMULS or "layers" not in keys or keys[0] in ("vision", "projector"):
            return var
        rank, n_contract = DECODER_MATMULS[name]
        value = var[...]
        q = quantize(value, scheme, n_contract=n_contract, n_lead=value.ndim - rank, group=group,
                     act_fp8=bool(fp8_activations), name=param_name(path))
        return var.replace(value=q)

    return jax.tree_util.tree_map_with_path(convert, state, is_leaf=is_var)


def _quantize_output(state: Any) -> Any:
    """`state` with the decoder's output matmul in int8: `lm_head` if it has one, else the tied embedding table."""
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    names = {param_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(state, is_leaf=is_var)[0]}
    prefix = next((p for p in ("decoder.", "") if f"{p}embedding" in names), None)
    if prefix is None:
        raise ConfigError("serve.quantize_lm_head: the model has no decoder embedding table to quantize")
    target = f"{prefix}lm_head" if f"{prefix}lm_head" in names else f"{prefix}embedding"

    def convert(path, var):
        if not is_var(var) or param_name(path) != target or isinstance(var[...], QUANTIZED):
            return var
        value = var[...]
        return var.replace(value=quantize(value, "int8") if target.endswith("lm_head") else quantize_table(value))

    return jax.tree_util.tree_map_with_path(convert, state, is_leaf=is_var)


def weight_bytes(state: Any) -> int:
    """Bytes of every parameter at its nominal width (int4 half a byte): what one decode step reads."""
    total = 0
    for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, QUANTIZED)):
        if isinstance(x, QUANTIZED):
            total += x.nbytes
        elif hasattr(x, "dtype"):
            bits = BITS["int4"] if x.dtype == jnp.int4 else 8 * x.dtype.itemsize
            total += x.size * bits // 8
    return total
