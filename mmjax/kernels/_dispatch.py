"""One dispatch mechanism for every op in `mmjax/kernels/`: a registry of implementations with capability guards.

Each op owns an `Op` registry. An implementation registers a function, a `supports(ctx) -> reason | None`
guard and a priority. `Op.select(impl, ctx)` returns the named implementation (raising with the guard's
reason if it cannot run) or, for `impl="auto"`, the highest-priority one whose guard passes, logging once
per distinct situation which candidates were skipped and why. `ctx` is a `Ctx`: the platform, the GPU's
compute capability, the dtype, whether the caller named the implementation, and op-specific facts
(shapes, flags) the guards read.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib.metadata
import importlib.util
import logging
import pkgutil
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from mmjax.kernels._sharding import active

log = logging.getLogger("mmjax.kernels")


@dataclasses.dataclass(frozen=True)
class Ctx:
    platform: str                      # 'cpu', 'gpu', 'tpu'
    dtype: Any                         # a numpy dtype
    capability: tuple[int, int] | None = None   # CUDA compute capability on GPU
    explicit: bool = False             # the caller named this implementation (not "auto")
    facts: tuple = ()                  # op-specific (key, value) pairs, hashable

    def get(self, key: str, default=None):
        return dict(self.facts).get(key, default)


@dataclasses.dataclass(frozen=True)
class Implementation:
    name: str
    fn: Callable
    supports: Callable[[Ctx], str | None]
    priority: int = 0


@functools.cache
def _device_info(backend: str) -> tuple[str, tuple[int, int] | None]:
    dev = jax.devices(backend)[0]
    cap = getattr(dev, "compute_capability", None)
    if dev.platform == "gpu" and cap:
        major, minor = str(cap).split(".")[:2]
        return "gpu", (int(major), int(minor))
    return dev.platform, None


_ASSUMED: contextvars.ContextVar[tuple[str, tuple[int, int] | None] | None] = contextvars.ContextVar(
    "mmjax_kernels_platform", default=None)


@contextlib.contextmanager
def assume_platform(platform: str, capability: tuple[int, int] | None = None) -> Iterator[None]:
    """Dispatch as if computing on `platform` ('cpu', 'gpu', 'tpu'): the guards see it instead of the backend's.

    Why: selection on another platform (e.g. which TPU kernels `auto` picks) is testable on a CPU; a chosen
    Pallas TPU kernel then runs in its interpret mode there. Only the dispatcher's view changes, not where
    XLA compiles."""
    token = _ASSUMED.set((platform, capability))
    try:
        yield
    finally:
        _ASSUMED.reset(token)


def platform_here() -> tuple[str, tuple[int, int] | None] | None:
    """(platform, capability) this process computes on, found without starting a backend (which must wait for
    XLA flags and jax.distributed); None while that cannot be told: an accelerator plugin is installed but no
    backend runs yet (a GPU's capability is only known from the device)."""
    if _ASSUMED.get() is not None:
        return _ASSUMED.get()
    from jax._src import xla_bridge  # private; getattr: the check is an optimisation, not a contract
    if getattr(xla_bridge, "backends_are_initialized", lambda: False)():
        return _device_info(jax.default_backend())
    first = (jax.config.jax_platforms or "").split(",")[0].strip()
    if first == "cpu" or (not first and not _accelerator_plugins()):
        return "cpu", None
    return None


def _accelerator_plugins() -> bool:
    """Whether a PJRT plugin (CUDA, ROCm) or libtpu is installed, so the default backend may be an accelerator."""
    if importlib.util.find_spec("libtpu") is not None:
        return True
    if importlib.util.find_spec("jax_plugins") is not None:
        import jax_plugins
        if any(True for _ in pkgutil.iter_modules(jax_plugins.__path__)):
            return True
    return bool(importlib.metadata.entry_points(group="jax_plugins"))


def make_ctx(dtype, *, explicit: bool = False, **facts) -> Ctx:
    """Ctx for the backend the current computation is compiled for (under jit: the default backend), or for
    the platform `assume_platform` set."""
    platform, cap = _ASSUMED.get() or _device_info(jax.default_backend())
    return Ctx(platform=platform, dtype=jnp.dtype(dtype), capability=cap, explicit=explicit,
               facts=tuple(sorted(facts.items())))


class Op:
    """The registry and dispatcher of one op (attention, cross_entropy, norms, ...)."""

    def __init__(self, name: str):
        self.name = name
        self._impls: dict[str, Implementation] = {}
        self._logged: set = set()

    def register(self, name: str, fn: Callable, supports: Callable[[Ctx], str | None], priority: int = 0):
        self._impls[name] = Implementation(name, fn, supports, priority)
        return fn

    def available(self) -> list[str]:
        return sorted(self._impls, key=lambda n: -self._impls[n].priority)

    def __getitem__(self, name: str) -> Implementation:
        return self._impls[name]

    def reason(self, impl: str, ctx: Ctx) -> str | None:
        if impl not in self._impls:
            return f"unknown {self.name} implementation {impl!r}; choose one of {self.available()} or 'auto'"
        return self._impls[impl].supports(ctx)

    def unsupported_here(self, impl: str, dtype: str = "auto") -> str | None:
        """Why `impl` (named in a config) cannot run on this machine in `dtype` (a name; "auto" = bfloat16 on
        an accelerator, float32 on CPU), or None. For config validation: nothing is traced and shapes are not
        known, so only the guards' platform, capability and dtype checks can fail. `auto` always passes, as
        does everything while the platform cannot be told without starting a backend (`platform_here`)."""
        if impl == "auto":
            return None
        if impl not in self._impls:
            return self.reason(impl, Ctx(platform="cpu", dtype=jnp.dtype(jnp.float32)))
        here = platform_here()
        if here is None:
            return None
        platform, capability = here
        if dtype == "auto":
            dtype = "float32" if platform == "cpu" else "bfloat16"
        return self.reason(impl, Ctx(platform=platform, dtype=jnp.dtype(dtype), capability=capability, explicit=True))

    def select(self, impl: str, ctx: Ctx) -> Implementation:
        if impl != "auto":
            reason = self.reason(impl, dataclasses.replace(ctx, explicit=True))
            if reason is not None:
                raise ValueError(f"{self.name} impl={impl!r} cannot run here: {reason}")
            return self._impls[impl]
        skipped = []
        for name in self.available():
            reason = self._impls[name].supports(ctx)
            if reason is None:
                key = (ctx.platform, str(ctx.dtype), ctx.facts, name)
                if skipped and key not in self._logged:
                    self._logged.add(key)
                    log.info("%s impl=auto chose %r on %s/%s; skipped: %s", self.name, name, ctx.platform,
                             ctx.dtype, "; ".join(skipped))
                return self._impls[name]
            skipped.append(f"{name} ({reason})")
        raise ValueError(f"no {self.name} implementation supports {ctx.platform}/{ctx.dtype}: {skipped}")


# ----------------------------------------------------------------------------------------------
# Guards shared by the ops


def any_float(ctx: Ctx) -> str | None:
    if not jnp.issubdtype(ctx.dtype, jnp.floating):
        return f"needs a floating dtype, got {ctx.dtype}"
    return None


def pallas_triton(ctx: Ctx, *, min_capability=(8, 0), dtypes=("float32", "bfloat16", "float16")) -> str | None:
    """Guard for Pallas kernels lowered through Triton.

    GPU: needs compute capability >= min_capability. CPU: runs only in interpret mode (orders of
    magnitude slower, for tests), so only when the caller names the implementation explicitly.
    """
    if str(ctx.dtype) not in dtypes:
        return f"dtype {ctx.dtype} not in {dtypes}"
    if ctx.get("row_wise") and not ctx.explicit and _sharded():
        return "under a sharding context XLA's fusion is partitioned natively; a custom call would be replicated"
    if ctx.platform == "gpu":
        if ctx.capability is None or ctx.capability < min_capability:
            return f"needs compute capability >= {min_capability[0]}.{min_capability[1]}, have {ctx.capability}"
        return None
    if ctx.platform == "cpu":
        return None if ctx.explicit else "CPU runs Pallas only in interpret mode (slow); name the impl to force it"
    return f"Pallas Triton lowering needs a CUDA GPU, not {ctx.platform}"


@functools.cache
def jax_triton_missing() -> str | None:
    """None if jax-triton and triton import, else why not (they are GPU-only packages: the `gpu` extra)."""
    for mod in ("triton", "jax_triton"):
        if importlib.util.find_spec(mod) is None:
            return f"package {mod!r} is not installed (pip install 'mmjax[gpu]')"
    return None


def jax_triton(ctx: Ctx, *, min_capability=(8, 0), dtypes=("float32", "bfloat16", "float16")) -> str | None:
    """Guard for native Triton kernels called through jax-triton: CUDA GPU only, no interpret mode."""
    if ctx.platform != "gpu":
        return f"jax-triton kernels run only on a CUDA GPU, not {ctx.platform}"
    if ctx.get("row_wise") and not ctx.explicit and _sharded():
        return "under a sharding context XLA's fusion is partitioned natively; a custom call would be replicated"
    if str(ctx.dtype) not in dtypes:
        return f"dtype {ctx.dtype} not in {dtypes}"
    if ctx.capability is None or ctx.capability < min_capability:
        return f"needs compute capability >= {min_capability[0]}.{min_capability[1]}, have {ctx.capability}"
    return jax_triton_missing()


def _sharded() -> bool:
    return active() is not None


def interpret() -> bool:
    """Pallas kernels run in interpret mode when compiled for CPU (tests)."""
    return jax.default_backend() == "cpu"
