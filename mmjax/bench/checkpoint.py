"""Checkpoint cost on a real train state: save time, restore time, and the train-loop stall per save.

The loop is the trainer's: the jitted train step on synthetic batches, `Checkpointer.save` between two
steps exactly where the trainer calls it. Stall = (time of the steps that overlap the save, plus the
time `save` blocked) - (the same number of steps at the baseline step time). Modes: "snapshot" (async
with a device snapshot, the default), "async" (Orbax's async save: blocks for the device-to-host copy),
"sync"; each saves `saves_per_mode` times (the first save of a process also pays set-up).
`python -m mmjax.tools.bench_checkpoint` is the CLI.
"""

from __future__ import annotations

import logging
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from mmjax.checkpoint import orbax_state as ckpt
from mmjax.config import Config
from mmjax.parallel.mesh import make_mesh, resolve_mesh_shape
from mmjax.parallel.rules import batch_sharding
from mmjax.parallel.sharding import context_from_config
from mmjax.training.init import create_train_state, model_setup
from mmjax.training.jit_step import jit_train_step
from mmjax.training.optimizer import learning_rate_schedule, make_optimizer

log = logging.getLogger(__name__)


def synthetic_batch(cfg: Config, mesh) -> dict[str, jax.Array]:
    """A text-only batch of the contract's shapes (one image slot, marked invalid)."""
    b, s = cfg.train.global_batch_size, cfg.model.max_seq_len
    v = cfg.model.vision
    rng = np.random.default_rng(0)
    host = {
        "tokens": rng.integers(0, cfg.model.vocab_size, (b, s), dtype=np.int32),
        "targets": rng.integers(0, cfg.model.vocab_size, (b, s), dtype=np.int32),
        "loss_mask": np.ones((b, s), np.float32),
        "segment_ids": np.ones((b, s), np.int32),
        "positions": np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy(),
        "images": np.zeros((b, 1, v.image_size, v.image_size, v.channels), np.float32),
        "image_valid": np.zeros((b, 1), bool),
    }
    return {k: jax.device_put(x, batch_sharding(mesh, x.ndim)) for k, x in host.items()}


def _timed_steps(step_fn, state, batch, n: int) -> tuple[Any, list[float]]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        state, metrics = step_fn(state, batch)
        jax.block_until_ready(metrics["train/loss"])
        times.append(time.perf_counter() - t0)
    return state, times


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


MODES = ("snapshot", "async", "sync")  # async + device snapshot (default) | Orbax async | synchronous


def run(cfg: Config, directory: str | Path, *, modes: tuple[str, ...] = MODES, saves_per_mode: int = 2,
        warmup: int = 3, baseline_steps: int = 10, max_overlap_steps: int = 400) -> dict[str, Any]:
    """`modes` in order (the last one must be "sync": its checkpoint is the one restored)."""
    if not modes or modes[-1] != "sync" or set(modes) - set(MODES):
        raise ValueError(f"modes must be taken from {MODES} and end with sync, got {modes}")
    directory = Path(directory)
    mesh = make_mesh(cfg)
    sizes = resolve_mesh_shape(cfg.mesh, mesh.devices.size)
    setup = model_setup(cfg, mesh, image_token_id=0)
    optimizer = make_optimizer(cfg)
    state, shardings = create_train_state(cfg, mesh, setup, optimizer)
    step_fn = jit_train_step(cfg, setup, optimizer, learning_rate_schedule(cfg), shardings,
                             context_from_config(cfg, mesh))
    batch = synthetic_batch(cfg, mesh)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    t0 = time.perf_counter()
    state, _ = _timed_steps(step_fn, state, batch, 1)
    compile_s = time.perf_counter() - t0
    state, _ = _timed_steps(step_fn, state, batch, warmup)
    state, base = _timed_steps(step_fn, state, batch, baseline_steps)
    step_s = statistics.median(base)
    result: dict[str, Any] = {"params": n_params, "state_bytes": state_bytes, "step_time_s": step_s,
                              "compile_s": compile_s, "mesh": sizes}
    log.info("baseline: %s", result)

    for mode in modes:  # several saves per mode, into one folder: the first save of a process pays set-up
        root = directory / mode
        shutil.rmtree(root, ignore_errors=True)
        saver = ckpt.Checkpointer(root, keep=1, async_save=mode != "sync", device_snapshot=mode == "snapshot")
        saves = []
        for _ in range(saves_per_mode):
            step = int(jax.device_get(state.step))
            meta = ckpt.run_meta(cfg, sizes, tuple(mesh.axis_names), step)
            t_start = time.perf_counter()
            blocked = saver.save(step, state, {"next_index": step}, meta)
            overlap: list[float] = []
            while saver.is_saving() and len(overlap) < max_overlap_steps:
                state, times = _timed_steps(step_fn, state, batch, 1)
                overlap += times
            saver.wait()
            total = time.perf_counter() - t_start
            stall = blocked + sum(overlap) - step_s * len(overlap)
            size = _dir_bytes(root / str(step))
            saves.append({"step": step, "save_blocked_s": blocked, "save_total_s": total,
                          "steps_during_save": len(overlap), "stall_s": stall, "stall_in_steps": stall / step_s,
                          "bytes_on_disk": size, "write_GBps": size / total / 1e9})
            log.info("%s save: %s", mode, saves[-1])
            state, _ = _timed_steps(step_fn, state, batch, 1)  # the next save is of a new step
        saver.close()
        summary = {key: statistics.mean(r[key] for r in saves) for key in saves[0] if key != "step"}
        result[mode] = {**summary, "saves": saves}
        if mode != "sync":
            shutil.rmtree(root, ignore_errors=True)  # keep one checkpoint on disk at a time

    # restore the sync checkpoint onto the same shardings (a fresh process would do exactly this)
    reader = ckpt.Checkpointer(directory / "sync", read_only=True)
    step = reader.all_steps()[-1]
    target = ckpt.abstract_like(state)
    jax.tree.map(lambda x: x.delete(), state)
    t0 = time.perf_counter()
    restored = reader.restore(step, target)
    jax.block_until_ready(restored.state)
    result["restore_s"] = time.perf_counter() - t0
    result["restore_GBps"] = result["sync"]["bytes_on_disk"] / result["restore_s"] / 1e9
    state, after = _timed_steps(step_fn, restored.state, batch, 2)  # training continues from the restore
    result["steps_after_restore_ok"] = bool(np.isfinite(after).all())
    for every in (100, 1000):
        for mode in modes:
            result[mode][f"stall_pct_of_step_time_every_{every}"] = 100 * result[mode]["stall_s"] / (every * step_s)
    shutil.rmtree(directory, ignore_errors=True)
    return result
