"""What the TPU implementations share: finding jax's Pallas TPU kernels, their guard, and CPU interpret mode.

jax ships Pallas TPU (Mosaic) kernels in `jax.experimental.pallas.ops.tpu` (flash attention with segment ids,
paged decode attention, ...). They are experimental modules whose presence and signatures may change between
jax releases, so each is imported lazily and its absence is a guard's reason, never an import error. On a CPU
they run only in Pallas' TPU interpret mode (`pltpu.force_tpu_interpret_mode`): slow, for tests, and only when
the implementation is named explicitly (or the dispatcher was told to assume a TPU: `assume_platform`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from types import ModuleType

import jax

from mmjax.kernels._dispatch import Ctx

OPS_PACKAGE = "jax.experimental.pallas.ops.tpu"


@functools.cache
def jax_tpu_kernel(name: str) -> ModuleType | str:
    """The module `jax.experimental.pallas.ops.tpu.<name>`, or why it cannot be used (a string)."""
    try:
        return importlib.import_module(f"{OPS_PACKAGE}.{name}")
    except Exception as e:  # noqa: BLE001 - any failure (missing module, broken import) means "not available"
        return f"jax {jax.__version__} has no usable {OPS_PACKAGE}.{name} ({type(e).__name__}: {e})"


def missing(name: str, *attrs: str) -> str | None:
    """None if jax's TPU kernel module `name` imports and has `attrs`, else why not."""
    mod = jax_tpu_kernel(name)
    if isinstance(mod, str):
        return mod
    absent = [a for a in attrs if not hasattr(mod, a)]
    return f"jax {jax.__version__}'s {OPS_PACKAGE}.{name} lacks {absent}" if absent else None


def _interpret_missing() -> str | None:
    from jax.experimental.pallas import tpu as pltpu
    if not hasattr(pltpu, "force_tpu_interpret_mode"):
        return f"jax {jax.__version__} has no Pallas TPU interpret mode (pltpu.force_tpu_interpret_mode)"
    return None


def pallas_tpu(ctx: Ctx, module: str, *attrs: str, dtypes=("float32", "bfloat16")) -> str | None:
    """Guard for a Pallas TPU kernel from jax's `module`: a TPU, or a CPU in interpret mode when named."""
    if str(ctx.dtype) not in dtypes:
        return f"dtype {ctx.dtype} not in {dtypes}"
    if ctx.platform == "cpu":
        if not ctx.explicit:
            return "CPU runs Pallas TPU kernels only in interpret mode (slow); name the impl to force it"
        reason = _interpret_missing()
        if reason:
            return reason
    elif ctx.platform != "tpu":
        return f"Pallas TPU (Mosaic) kernels need a TPU, not {ctx.platform}"
    return missing(module, *attrs)


def interpret_if_cpu():
    """Context to trace a Pallas TPU kernel in: TPU interpret mode when compiling for the CPU, else nothing."""
    if jax.default_backend() == "cpu":
        from jax.experimental.pallas import tpu as pltpu
        return pltpu.force_tpu_interpret_mode()
    return contextlib.nullcontext()
