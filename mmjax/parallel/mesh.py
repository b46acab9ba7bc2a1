"""Build the device mesh from `cfg.mesh` and check that the model and batch fit it.

Axis order is (data, fsdp, pipeline, sequence, tensor): tensor is innermost, so on GPUs the
tensor-parallel group is made of neighbouring devices (same NVLink island); on TPUs the grid follows the
physical torus (`mesh_tpu.py`). All axes are `Auto`
so GSPMD propagates shardings from the annotations; the mode is set explicitly because
`jax.make_mesh` defaults to Explicit axes on jax 0.10.
"""

from __future__ import annotations

import logging
import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from mmjax.config import Config, MeshConfig
from mmjax.errors import ConfigError
from mmjax.parallel.mesh_tpu import is_tpu, tpu_grid

log = logging.getLogger(__name__)

AXES = ("data", "fsdp", "pipeline", "sequence", "tensor")
BATCH_AXES = ("data", "fsdp")


def resolve_mesh_shape(mesh_cfg: MeshConfig, num_devices: int) -> dict[str, int]:
    """Sizes of every mesh axis, with a -1 replaced by the remaining devices."""
    sizes = {a: getattr(mesh_cfg, a) for a in AXES}
    known = math.prod(s for s in sizes.values() if s != -1)
    if -1 in sizes.values():
        if num_devices % known:
            raise ConfigError(
                f"mesh sizes {sizes} leave no integer size for the -1 axis with {num_devices} devices; "
                f"make the fixed axes multiply to a divisor of {num_devices}")
        sizes = {k: (num_devices // known if v == -1 else v) for k, v in sizes.items()}
    if math.prod(sizes.values()) != num_devices:
        raise ConfigError(
            f"mesh sizes {sizes} multiply to {math.prod(sizes.values())} but {num_devices} devices are "
            "present; set one mesh axis to -1 or make them multiply to the device count")
    return sizes


def make_mesh(cfg: Config, devices: list | None = None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_mesh_shape(cfg.mesh, len(devices))
    check_fits(cfg, sizes)
    shape = tuple(sizes[a] for a in AXES)
    dcn = {a: getattr(cfg.mesh, f"dcn_{a}", 1) for a in AXES}
    if math.prod(dcn.values()) == 1:  # on TPUs ordered by the torus, elsewhere in jax.devices() order
        grid = tpu_grid(shape, devices) if is_tpu(devices) else np.asarray(devices).reshape(shape)
    else:
        grid = hybrid_grid(sizes, dcn, devices)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def hybrid_grid(sizes: dict[str, int], dcn: dict[str, int], devices: list) -> np.ndarray:
    """Device grid whose `dcn_*` factor of data/fsdp/pipeline runs across granules (processes, or TPU slices)."""
    for a, n in dcn.items():
        if sizes[a] % n:
            raise ConfigError(f"mesh.dcn_{a}={n} does not divide mesh.{a}={sizes[a]}")
    slices = {getattr(d, "slice_index", None) for d in devices}
    by_process = slices == {None} or len(slices) == 1
    granules = len({d.process_index for d in devices}) if by_process else len(slices)
    if math.prod(dcn.values()) != granules:
        raise ConfigError(
            f"mesh.dcn_* = {[dcn[a] for a in AXES if dcn[a] > 1]} multiply to {math.prod(dcn.values())} but the run "
            f"has {granules} {'processes' if by_process else 'slices'}; make them equal (or set mesh.dcn_*=1)")
    ici = [sizes[a] // dcn[a] for a in AXES]
    kw = dict(process_is_granule=by_process)
    try:
        return mesh_utils.create_hybrid_device_mesh(ici, [dcn[a] for a in AXES], devices, **kw)
    except (ValueError, NotImplementedError, AssertionError) as e:
        if not is_tpu(devices):
            raise
        log.warning("per-slice mesh %s does not map onto whole physical TPU axes (%s); splitting them", ici, e)
        return mesh_utils.create_hybrid_device_mesh(ici, [dcn[a] for a in AXES], devices,
                                                    allow_split_physical_axes=True, **kw)


def data_parallel_size(sizes: dict[str, int]) -> int:
    return math.prod(sizes[a] for a in BATCH_AXES)


def check_fits(cfg: Config, sizes: dict[str, int]) -> None:
    """Sizes that must divide the model and batch dimensions they shard."""
    dp = data_parallel_size(sizes)
    per_step = cfg.train.global_batch_size // cfg.train.grad_accum_steps
    if per_step % dp:
        raise ConfigError(
            f"train.global_batch_size={cfg.train.global_batch_size} / train.grad_accum_steps="
            f"{cfg.train.grad_accum_steps} = {per_step} rows per micro-step is not divisible by the "
            f"data-parallel size data x fsdp = {dp}; change the batch or the mesh")
    t = sizes["tensor"]
    text, vision = cfg.model.text, cfg.model.vision
    for key, value in [("model.text.n_kv_heads", text.n_kv_heads), ("model.text.n_heads", text.n_heads),
                       ("model.text.mlp_dim", text.mlp_dim), ("model.vocab_size", cfg.model.vocab_size),
                       ("model.vision.n_heads", vision.n_heads), ("model.vision.mlp_dim", vision.mlp_dim)]:
        if value % t:
            raise ConfigError(f"{key}={value} is not divisible by mesh.tensor={t}; pick a tensor size dividing it")
    if cfg.model.max_seq_len % sizes["sequence"]:
        raise ConfigError(f"model.max_seq_len={cfg.model.max_seq_len} is not divisible by "
                          f"mesh.sequence={sizes['sequence']}")
