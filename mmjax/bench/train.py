"""Training throughput on synthetic batches: tokens/s, MFU, memory, compile time and a profile summary.

The data pipeline is left out on purpose (it has its own benchmark): every step trains on the same
device-resident batch of full-length rows, so the number is the train step's speed alone. MFU uses
`mmjax.observe.flops` (6N + causal attention pairs + vision encoder), the same accounting as `train/mfu`.
The kernels table's train-step rows (`train_step_section`, a `python -m mmjax.tools.bench_kernels` section)
come from here too.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import platform
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from mmjax.bench.kernels import Row
from mmjax.config import Config, load_config
from mmjax.observe.flops import peak_flops_per_device, training_flops
from mmjax.observe.memory import is_device_oom
from mmjax.observe.metrics import memory_metrics
from mmjax.observe.profile import Profiler, summarize_host_trace
from mmjax.parallel.mesh import make_mesh
from mmjax.parallel.sharding import context_from_config
from mmjax.training.feed import to_global_batch
from mmjax.training.init import create_train_state, model_setup
from mmjax.training.jit_step import jit_train_step
from mmjax.training.optimizer import learning_rate_schedule, make_optimizer

log = logging.getLogger(__name__)


def synthetic_batch(cfg: Config, batch_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Full rows of random tokens (one segment each); with a vision tower, one image per row at the start."""
    m = cfg.model
    s = m.max_seq_len
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, m.vocab_size - 1, (batch_size, s), dtype=np.int32)
    batch = {
        "tokens": tokens,
        "targets": np.roll(tokens, -1, axis=1),
        "loss_mask": np.ones((batch_size, s), np.float32),
        "segment_ids": np.ones((batch_size, s), np.int32),
        "positions": np.broadcast_to(np.arange(s, dtype=np.int32), (batch_size, s)).copy(),
    }
    if not m.text_only:
        v = m.vision
        batch["tokens"][:, 1:1 + m.image_tokens] = image_token_id(cfg)
        batch["images"] = rng.standard_normal((batch_size, 1, v.image_size, v.image_size, v.channels), np.float32)
        batch["image_valid"] = np.ones((batch_size, 1), bool)
    return batch


CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_cache_hits = [0]  # persistent compilation cache hits in this process (jax.monitoring events)
_counting = []


def cache_hits() -> int:
    """Programs this process has loaded from the persistent compilation cache so far."""
    if not _counting:  # one listener for the process: jax.monitoring has no public way to remove one
        jax.monitoring.register_event_listener(
            lambda event, **kw: _cache_hits.__setitem__(0, _cache_hits[0] + (event == CACHE_HIT_EVENT)))
        _counting.append(True)
    return _cache_hits[0]


def image_token_id(cfg: Config) -> int:
    return cfg.model.vocab_size - 1


def run_train_bench(cfg: Config, *, steps: int = 20, warmup: int = 3, profile_steps: int = 2,
                    out_dir: str | Path | None = None, hlo_path: str | Path | None = None,
                    profile_compile: bool = False) -> dict[str, Any]:
    """Compile, warm up, time `steps` train steps, then profile `profile_steps` more; returns the result dict.

    `hlo_path`: also write the compiled step's optimized HLO there. The profile names kernels by their HLO
    fusion names (`fusion_67`, `wrapped_convert`); the HLO says which op each one is and how many times a
    custom call appears (how a cross-entropy cast left in a loop and a duplicated attention kernel were found).
    `profile_compile`: trace the compilation with the host profiler and rank its phases (`compile_profile`): where
    a compile time goes (HLO passes, autotuning, kernel compilation); tracing and lowering are timed apart
    (`lower_s`).
    """
    mesh = make_mesh(cfg)
    setup = model_setup(cfg, mesh, image_token_id=image_token_id(cfg))
    optimizer, schedule = make_optimizer(cfg), learning_rate_schedule(cfg)
    state, shardings = create_train_state(cfg, mesh, setup, optimizer)
    n_params = setup.num_params
    step_fn = jit_train_step(cfg, setup, optimizer, schedule, shardings, context_from_config(cfg, mesh))
    host = synthetic_batch(cfg, cfg.train.global_batch_size, cfg.train.seed)
    batch = to_global_batch(host, mesh)

    hits_before = cache_hits()
    start = time.perf_counter()
    lowered = step_fn.lower(state, batch)
    lower_s = time.perf_counter() - start
    compile_trace = Path(out_dir or "/tmp/mmjax_bench") / "compile_profile"
    if profile_compile:  # the Python tracer off: its events would crowd the compiler's phases out of the trace
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0
        jax.profiler.start_trace(str(compile_trace), profiler_options=options)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start
    # a step loaded from the persistent compilation cache (parallel.compilation_cache_dir) is not a cold compile
    from_cache = cache_hits() > hits_before
    compile_profile = None
    if profile_compile:
        jax.profiler.stop_trace()
        compile_profile = summarize_host_trace(compile_trace)
    if hlo_path is not None:
        Path(hlo_path).parent.mkdir(parents=True, exist_ok=True)
        Path(hlo_path).write_text(compiled.as_text())
    memory_analysis = None
    try:
        ma = compiled.memory_analysis()
        memory_analysis = {k: int(getattr(ma, k)) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                                            "temp_size_in_bytes", "generated_code_size_in_bytes")
                           if hasattr(ma, k)}
    except Exception as e:  # not every backend implements it
        log.info("memory_analysis unavailable: %s", e)

    losses = []
    for _ in range(warmup):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(state)
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = compiled(state, batch)
        losses.append(metrics["train/loss"])
    jax.block_until_ready(state)
    elapsed = time.perf_counter() - start
    losses = [float(x) for x in jax.device_get(losses)]

    step_s = elapsed / steps
    tokens = float(np.sum(host["segment_ids"] > 0))
    pairs = float(np.sum((host["positions"] + 1) * (host["segment_ids"] > 0)))
    images = float(np.sum(host.get("image_valid", 0)))
    flops = training_flops(cfg.model).step_flops(tokens, pairs, images)
    device = jax.devices()[0]
    peak = peak_flops_per_device(device, cfg.observe.peak_flops_per_device)
    n_dev = mesh.devices.size
    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device.device_kind, "devices": n_dev, "platform": device.platform,
        "versions": {"jax": jax.__version__, "python": platform.python_version()},
        "model": {"params": n_params, "text_only": cfg.model.text_only, "dim": cfg.model.text.dim,
                  "layers": cfg.model.text.n_layers, "vocab": cfg.model.vocab_size, "remat": cfg.model.remat,
                  "compute_dtype": cfg.model.compute_dtype, "attention_impl": cfg.model.attention_impl},
        "batch": {"rows": cfg.train.global_batch_size, "seq_len": cfg.model.max_seq_len,
                  "images_per_step": images, "grad_accum_steps": cfg.train.grad_accum_steps},
        "steps_timed": steps, "warmup_steps": warmup,
        "step_time_s": step_s,
        "tokens_per_sec": tokens / step_s,
        "tokens_per_sec_per_device": tokens / step_s / n_dev,
        "model_tflop_per_step": flops / 1e12,
        "achieved_tflops_per_device": flops / step_s / n_dev / 1e12,
        "peak_tflops_per_device": peak / 1e12 if peak else None,
        "mfu": flops / step_s / (n_dev * peak) if peak else None,
        "compile_s": compile_s,
        "lower_s": lower_s,
        "compile_from_cache": from_cache,
        "compiled_memory": memory_analysis,
        "memory": memory_metrics(),
        "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
        "hlo_file": None if hlo_path is None else str(hlo_path),
    }
    if compile_profile is not None:
        result["compile_profile"] = compile_profile
    if profile_steps > 0:
        profiler = Profiler([(steps + warmup + 1, steps + warmup + profile_steps)],
                            Path(out_dir or "/tmp/mmjax_bench") / "profile")
        for i in range(steps + warmup + 1, steps + warmup + profile_steps + 1):
            profiler.before_step(i, state)
            state, metrics = compiled(state, batch)
            summary = profiler.after_step(i, state)
        result["profile"] = summary
    return result


def format_result(r: dict[str, Any]) -> str:
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
    mem = max((v for k, v in r["memory"].items() if k.endswith("peak_bytes_in_use")), default=None)
    lines = [
        f"device            {r['device']} x{r['devices']}",
        f"model             {r['model']['params'] / 1e9:.3f}B params, text_only={r['model']['text_only']}, "
        f"remat={r['model']['remat']}",
        f"batch             {r['batch']['rows']} x {r['batch']['seq_len']}",
        f"step time         {1e3 * r['step_time_s']:.1f} ms",
        f"tokens/s          {r['tokens_per_sec']:,.0f}",
        f"MFU               {mfu}  ({r['achieved_tflops_per_device']:.0f} TFLOP/s per device)",
        f"compile           {r['compile_s']:.1f} s (tracing and lowering {r['lower_s']:.1f} s"
        f"{'; loaded from the persistent compilation cache' if r.get('compile_from_cache') else ''})",
        f"peak memory       {mem / 2**30:.1f} GiB" if mem else "peak memory       n/a",
    ]
    if phases := (r.get("compile_profile") or {}).get("phases"):
        lines.append("compile phases (summed over the compiler's threads; a phase includes its children)")
        for ph in phases[:20]:
            lines.append(f"  {ph['total_ms'] / 1e3:7.2f} s  {ph['count']:5d}x  {ph['name'][:90]}")
    p = r.get("profile")
    if p and p.get("devices"):
        overlap = "n/a (no collectives)" if p["nccl_overlap_pct"] is None else f"{p['nccl_overlap_pct']:.1f}%"
        lines.append(f"profile           compute {100 * p['compute_share']:.1f}%, communication "
                     f"{100 * p['communication_share']:.1f}%, overlapped {100 * p['overlapped_share']:.1f}%, "
                     f"idle {100 * p['idle_share']:.1f}%, NCCL overlap {overlap}")
        for k in p["top_kernels"][:8]:
            lines.append(f"  {100 * k['share']:5.1f}%  {k['count']:5d}x  {k['name'][:90]}")
        lines.append("kernel families (all kernels)")
        for f in p.get("kernel_families", [])[:12]:
            lines.append(f"  {100 * f['share']:5.1f}%  {f['count']:5d}x  {f['family'][:90]}")
    for peer in r.get("peers", []):
        if "tokens_per_s" in peer:
            lines.append(f"peer {peer['peer']:<16} {peer['tokens_per_s']:,.0f} tokens/s ({1e3 * peer['step_s']:.1f} ms)"
                         f", mmjax / peer = {peer['mmjax_ratio']:.2f}x")
        else:
            lines.append(f"peer {peer['peer']:<16} skipped: {peer['skipped']}")
    return "\n".join(lines)


def with_overrides(cfg: Config, **model_fields: Any) -> Config:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model_fields))


def run_with_remat_fallback(cfg: Config, remats: tuple[str, ...], **kwargs: Any) -> dict[str, Any]:
    """`run_train_bench` with `model.remat` = each of `remats` in turn until one fits in device memory."""
    errors = []
    for remat in remats or (cfg.model.remat,):
        try:
            result = run_train_bench(with_overrides(cfg, remat=remat), **kwargs)
            result["out_of_memory_with"] = errors
            return result
        except Exception as e:
            if not is_device_oom(e):
                raise
            log.warning("remat=%s does not fit in device memory; trying the next policy", remat)
            errors.append(remat)
            jax.clear_caches()
    raise MemoryError(f"no remat policy of {remats} fits in device memory")


# ----------------------------------------------------------------------------------------------
# The train-step section of the kernels table (`python -m mmjax.tools.bench_kernels --sections train_step`)


def train_configs() -> dict[str, dict[str, str]]:
    """Kernel choices (model fields) to time the train step with, by name (`--train-impls` picks among them)."""
    every_xla = dict(attention_impl="xla", norm_impl="xla", loss_impl="xla", swiglu_impl="xla")
    auto = dict(attention_impl="auto", norm_impl="auto", loss_impl="auto", swiglu_impl="auto")
    # "xla" everywhere materialises [B, H, S, S] scores and [B*S, V] logits: at B8 S2048 it does not fit in
    # an H200's memory (docs/perf/kernels.md), so baselines with cuDNN attention are timed as well.
    return {"auto": auto, "auto+cudnn_attention": dict(auto, attention_impl="cudnn"),
            "auto+pallas_attention": dict(auto, attention_impl="pallas"),
            "auto+mgpu_fwd_pallas_bwd": dict(auto, attention_impl="mgpu"),
            "auto+xla_swiglu": dict(auto, swiglu_impl="xla"), "xla": every_xla,
            "cudnn_attention+xla": dict(every_xla, attention_impl="cudnn")}


def decoder_config(batch: int, seq: int, config: str = "models/llama_1b.yaml", overrides: tuple[str, ...] = ()
                   ) -> Config:
    """`config`'s decoder alone (`model.text_only`) in bf16 compute, trained on `batch` rows of `seq` tokens."""
    return load_config(config, ["model.text_only=true", "model.compute_dtype=bfloat16",
                                f"train.global_batch_size={batch}", f"model.max_seq_len={seq}", *overrides])


def train_step_rows(rows: list, base: Config, configs: dict[str, dict[str, Any]], *, steps: int = 10,
                    warmup: int = 3) -> None:
    """Append one kernels-table `Row` per configuration of `configs` (model fields over `base`).

    The step is `run_train_bench`'s (the trainer's step, MFU from `mmjax.observe.flops`); a configuration
    that fails (e.g. runs out of memory) becomes a row with the error instead of ending the run.
    """
    shape = f"B{base.train.global_batch_size} S{base.model.max_seq_len}"
    for name, fields in configs.items():
        try:
            r = run_train_bench(with_overrides(base, **fields), steps=steps, warmup=warmup, profile_steps=0)
        except Exception as e:  # noqa: BLE001 - one failing configuration must not end the run
            log.warning("train step %s failed: %s", name, e)
            rows.append(Row("train_step", name, shape, None, note=f"failed: {type(e).__name__}: {str(e)[:300]}"))
        else:
            mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%} of {r['peak_tflops_per_device']:.0f} TFLOP/s"
            rows.append(Row("train_step", name, f"{shape} params={r['model']['params'] / 1e9:.2f}B",
                            r["step_time_s"] * 1e3, tflops=r["achieved_tflops_per_device"],
                            note=f"{r['tokens_per_sec']:,.0f} tok/s, loss {r['loss_last']:.3f}, MFU {mfu}; {fields}"))
            log.info("%s", rows[-1])
        jax.clear_caches()  # the next configuration compiles afresh; free this one's executables


def train_step_section(rows: list, configs: dict[str, dict[str, Any]] | None = None, *, steps: int = 10) -> None:
    """B8 x 2048 for every configuration, then B2 x 2048 for `auto` against `xla` everywhere: the batch at
    which the all-XLA step (full [B, H, S, S] scores, full-vocab logits) fits in memory."""
    configs = configs or train_configs()
    train_step_rows(rows, decoder_config(8, 2048), configs, steps=steps)
    train_step_rows(rows, decoder_config(2, 2048), {k: v for k, v in configs.items() if k in ("auto", "xla")},
                    steps=steps)
