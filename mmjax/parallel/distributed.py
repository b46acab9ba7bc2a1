"""Process start-up for parallel runs: XLA flags, then `jax.distributed.initialize`.

Both must happen before JAX starts its backend (the first device query), so `mmjax.train` calls
`setup_runtime(cfg)` right after parsing the config.

Multi-process: set `distributed.coordinator_address` (+ `num_processes`, `process_id`), or the
environment variables MMJAX_COORDINATOR_ADDRESS / MMJAX_NUM_PROCESSES / MMJAX_PROCESS_ID, or set
`distributed.initialize=true` and let JAX detect the cluster (SLURM, Open MPI, Kubernetes, TPU pods).
On CPU the cross-process collectives go through gloo.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax

from mmjax.config import Config, cache_root
from mmjax.errors import ConfigError

log = logging.getLogger(__name__)

# Communication/compute overlap on NVIDIA GPUs (the set MaxText and the JAX GPU performance guide use):
GPU_OVERLAP_FLAGS = (
    # schedule collectives asynchronously and overlap them with independent compute
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    # collectives on a high-priority stream so they are not starved by compute kernels
    "--xla_gpu_enable_highest_priority_async_stream=true",
    # combine small collectives (e.g. per-layer FSDP all-gathers) into ~128 MiB transfers
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    # start the next layer's all-gather / previous layer's reduce-scatter inside the scanned layer loop
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
)

XLA_FLAG_PRESETS = {"none": (), "gpu_overlap": GPU_OVERLAP_FLAGS}

_ENV = {"coordinator_address": "MMJAX_COORDINATOR_ADDRESS", "num_processes": "MMJAX_NUM_PROCESSES",
        "process_id": "MMJAX_PROCESS_ID"}


# Every run (a later setting of the same flag wins; the CPU backend parses and ignores them): the layer scan's
# residual stacks are not zero-filled before the loop overwrites them, and the loop is unrolled by two with
# double-buffered operands. Both measured faster on the 1.2B train step (docs/perf/train.md, "XLA flags").
DEFAULT_FLAGS = ("--xla_gpu_enable_dus_accumulator_zero_init_elimination=true",
                 "--xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_DOUBLE_BUFFER")

# model.matmul_precision=fp8: Triton's GEMM fusion would take the fp8 dots (and run them slower than bf16);
# without it they become cuBLASLt fp8 GEMMs with the scales folded in (docs/perf/train.md, "fp8")
FP8_FLAGS = ("--xla_gpu_enable_triton_gemm=false",)


def xla_flags(cfg: Config) -> list[str]:
    """The defaults, then the flags `parallel.xla_flags_preset`, fp8 matmuls and `parallel.xla_flags` ask for
    (later ones win)."""
    fp8 = FP8_FLAGS if cfg.model.matmul_precision == "fp8" else ()
    flags = {f.split("=")[0]: f for f in (*DEFAULT_FLAGS, *XLA_FLAG_PRESETS[cfg.parallel.xla_flags_preset], *fp8,
                                          *cfg.parallel.xla_flags.split())}
    return list(flags.values())


def apply_xla_flags(cfg: Config) -> None:
    """Append the configured flags to XLA_FLAGS (read once, when the backend starts); existing wins."""
    current = os.environ.get("XLA_FLAGS", "").split()
    present = {f.split("=")[0] for f in current}
    extra = [f for f in xla_flags(cfg) if f.split("=")[0] not in present]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join(current + extra)
        log.info("XLA_FLAGS += %s", " ".join(extra))


# what JAX reads for its GPU allocator's share of memory (the second is the older spelling; JAX refuses both at once)
MEM_FRACTION_ENV = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")


def apply_gpu_memory_fraction(cfg: Config) -> None:
    """Export `parallel.gpu_memory_fraction` for the allocator (read once, when the backend starts).

    A share already in the environment, or `XLA_PYTHON_CLIENT_PREALLOCATE=false` there, wins."""
    fraction = cfg.parallel.gpu_memory_fraction
    if not fraction or any(os.environ.get(k) for k in MEM_FRACTION_ENV):
        return
    if os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() in ("false", "0"):
        return
    os.environ[MEM_FRACTION_ENV[0]] = f"{fraction:g}"
    log.info("%s=%g (parallel.gpu_memory_fraction)", MEM_FRACTION_ENV[0], fraction)


# The persistent compilation cache's thresholds (jax's own defaults skip compiles under 1 s): every compile of
# 0.1 s or more is written, so a warm start also skips the dozens of sub-second compiles of parameter init,
# sharding and evaluation, not only the train step's. Entries of any size are kept.
CACHE_MIN_COMPILE_S = 0.1
CACHE_MIN_ENTRY_BYTES = 0
CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"


def compilation_cache_dir(cfg: Config) -> Path | None:
    """The folder `parallel.compilation_cache_dir` names: auto = $JAX_COMPILATION_CACHE_DIR, else
    <mmjax cache>/xla; None for "" (off)."""
    setting = cfg.parallel.compilation_cache_dir
    if setting == "":
        return None
    if setting == "auto":
        return Path(os.environ[CACHE_ENV]).expanduser() if os.environ.get(CACHE_ENV) else cache_root() / "xla"
    return Path(setting).expanduser()


def apply_compilation_cache(cfg: Config) -> Path | None:
    """Turn XLA's persistent compilation cache on (or off) before the first compile; returns its folder.

    The thresholds above apply unless the environment sets jax's own (JAX_PERSISTENT_CACHE_MIN_*)."""
    folder = compilation_cache_dir(cfg)
    if folder is None:
        jax.config.update("jax_enable_compilation_cache", False)
        log.info("persistent compilation cache off (parallel.compilation_cache_dir is empty)")
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if cfg.parallel.compilation_cache_dir != "auto":
            raise ConfigError(f"parallel.compilation_cache_dir: cannot create {folder} ({e}); set another folder "
                              "or \"\" (off)") from None
        log.warning("no persistent compilation cache: cannot create %s (%s); every run compiles afresh "
                    "(set parallel.compilation_cache_dir to a writable folder)", folder, e)
        return None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    for name, value in (("jax_persistent_cache_min_compile_time_secs", CACHE_MIN_COMPILE_S),
                        ("jax_persistent_cache_min_entry_size_bytes", CACHE_MIN_ENTRY_BYTES)):
        if name.upper() not in os.environ:
            jax.config.update(name, value)
    log.info("persistent compilation cache: %s", folder)
    return folder


def distributed_args(cfg: Config) -> dict | None:
    """kwargs for `jax.distributed.initialize`, or None for a single-process run."""
    d = cfg.distributed
    address = d.coordinator_address or os.environ.get(_ENV["coordinator_address"], "")
    if not (address or d.initialize):
        return None
    kwargs: dict = {"initialization_timeout": d.initialization_timeout}
    if address:
        kwargs["coordinator_address"] = address
    for key, unset in (("num_processes", 0), ("process_id", -1)):
        value = getattr(d, key)
        if value == unset and os.environ.get(_ENV[key]):
            try:
                value = int(os.environ[_ENV[key]])
            except ValueError:
                raise ConfigError(f"{_ENV[key]}={os.environ[_ENV[key]]!r} is not an integer") from None
        if value != unset:
            kwargs[key] = value
    if address and ("num_processes" not in kwargs or "process_id" not in kwargs):
        raise ConfigError(f"distributed.coordinator_address={address} needs distributed.num_processes and "
                          "distributed.process_id (or leave the address empty and set distributed.initialize=true "
                          "to let JAX detect the cluster)")
    if "num_processes" in kwargs and "process_id" in kwargs and not 0 <= kwargs["process_id"] < kwargs["num_processes"]:
        raise ConfigError(f"distributed.process_id={kwargs['process_id']} is outside "
                          f"[0, distributed.num_processes={kwargs['num_processes']})")
    return kwargs


def configure_backend(cfg: Config) -> None:
    """What the backend reads when it starts: XLA flags, the GPU memory share, the persistent compilation cache."""
    apply_xla_flags(cfg)
    apply_gpu_memory_fraction(cfg)
    apply_compilation_cache(cfg)


def setup_runtime(cfg: Config) -> None:
    """`configure_backend` and (if configured) the multi-process runtime; call before any JAX device use."""
    configure_backend(cfg)
    kwargs = distributed_args(cfg)
    if kwargs is None:
        return
    jax.config.update("jax_cpu_collectives_implementation", cfg.distributed.cpu_collectives)
    jax.distributed.initialize(**kwargs)
    log.info("jax.distributed: process %d of %d, %d local / %d global devices", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())
