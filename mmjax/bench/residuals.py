"""What a training step keeps from its forward pass for its backward pass, per layer of each layer scan.

Under `lax.scan` every tensor the backward needs from a layer's forward is stacked over the layers ([L, ...]).
On a GPU each one that a custom call produced (cuBLAS GEMMs, Pallas kernels) is copied into its stack in the
forward pass and out of it in the backward pass: those are the `memcpy` kernels of a train-step profile, so
their time follows these bytes. The inventory comes from an abstract trace of the gradient (no device memory,
no compile), with the kernel choices of the platform asked for (`kernels._dispatch.assume_platform`), so a
GPU step's residuals can be listed and changed on a CPU.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from mmjax.bench.train import image_token_id, synthetic_batch
from mmjax.config import Config
from mmjax.kernels import _dispatch
from mmjax.model import MLLM
from mmjax.parallel.mesh import make_mesh
from mmjax.parallel.sharding import context_from_config, in_sharding_context
from mmjax.training.steps import loss_sums

# value-preserving primitives: a residual made by one is a second copy of a value saved elsewhere as well
IDENTITIES = frozenset({"name", "sharding_constraint", "copy"})


@dataclasses.dataclass(frozen=True)
class Residual:
    """One tensor a layer saves: its per-layer shape and dtype and the primitive that made it."""

    shape: tuple[int, ...]
    dtype: str
    producer: str

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * jnp.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class ScanResiduals:
    """A forward scan of `length` iterations (layers, or chunks of a chunked loss) and what each one saves."""

    length: int
    residuals: tuple[Residual, ...]

    @property
    def bytes_per_iteration(self) -> int:
        return sum(r.bytes for r in self.residuals)

    @property
    def bytes(self) -> int:
        return self.length * self.bytes_per_iteration


def _subjaxprs(eqn) -> list:
    out = []
    for v in eqn.params.values():
        for sub in v if isinstance(v, (tuple, list)) else (v,):
            inner = getattr(sub, "jaxpr", sub)
            if hasattr(inner, "eqns"):
                out.append(inner)
    return out


def forward_scans(jaxpr) -> list[ScanResiduals]:
    """The scans of `jaxpr` (and its sub-jaxprs) whose stacked outputs a later scan of the same jaxpr reads:
    a forward pass's residual stacks, which the backward scan takes as its per-iteration inputs."""
    found: list[ScanResiduals] = []
    scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    for i, eqn in enumerate(scans):
        ys = eqn.outvars[eqn.params["num_carry"]:]
        read_later = {id(v) for later in scans[i + 1:] for v in later.invars}
        if not any(id(v) in read_later for v in ys):
            continue
        body = eqn.params["jaxpr"].jaxpr
        made_by = {id(o): e.primitive.name for e in body.eqns for o in e.outvars}
        outs = body.outvars[eqn.params["num_carry"]:]
        found.append(ScanResiduals(eqn.params["length"], tuple(
            Residual(tuple(v.aval.shape), str(v.aval.dtype), made_by.get(id(v), "input")) for v in outs)))
    for eqn in jaxpr.eqns:
        for sub in _subjaxprs(eqn):
            found += forward_scans(sub)
    return found


def train_step_residuals(cfg: Config, batch_size: int, *, platform: str | None = "gpu",
                         capability: tuple[int, int] | None = (9, 0), devices: int = 1) -> list[ScanResiduals]:
    """The forward scans' residuals of `cfg`'s training loss gradient on synthetic full rows of `batch_size`,
    traced with the kernels `auto` picks on `platform` (None: this machine's) under the sharding context of
    `cfg.mesh` over the first `devices` local devices (as many as the run it stands for would have)."""
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in synthetic_batch(cfg, batch_size).items()}

    def trace() -> Any:
        model = nnx.eval_shape(lambda: MLLM(cfg.model, image_token_id=image_token_id(cfg), rngs=nnx.Rngs(0)))
        graphdef, params = nnx.split(model)

        def loss(p, b):
            total, count = loss_sums(nnx.merge(graphdef, p), b)
            return total / count

        loss = in_sharding_context(loss, context_from_config(cfg, make_mesh(cfg, jax.devices()[:devices])))
        return jax.make_jaxpr(jax.grad(loss))(params, batch).jaxpr

    if platform is None:
        return forward_scans(trace())
    with _dispatch.assume_platform(platform, capability):
        return forward_scans(trace())


def to_json(scans: list[ScanResiduals]) -> list[dict]:
    return [dict(length=s.length, bytes_per_iteration=s.bytes_per_iteration, bytes=s.bytes,
                 residuals=[dict(shape=list(r.shape), dtype=r.dtype, producer=r.producer, bytes=r.bytes)
                            for r in s.residuals]) for s in scans]


def format_table(scans: list[ScanResiduals]) -> str:
    lines = []
    for s in scans:
        lines.append(f"scan of {s.length}: {s.bytes_per_iteration / 2**20:.1f} MiB per iteration, "
                     f"{s.bytes / 2**30:.2f} GiB in all")
        for r in sorted(s.residuals, key=lambda r: -r.bytes):
            flag = "  (an identity's output: a second copy)" if r.producer in IDENTITIES else ""
            lines.append(f"  {r.dtype:>9s} {str(list(r.shape)):28s} {r.bytes / 2**20:9.1f} MiB  <- {r.producer}{flag}")
    return "\n".join(lines)
