"""The pipeline a config asks for: its schedule and layer layout, and the checks that reject bad layouts
at config time with one line naming the fix."""

from __future__ import annotations

import dataclasses
import logging
import math

from mmjax.errors import ConfigError
from mmjax.parallel.rules import rules_from_config, spec_axes
from mmjax.training.pipeline.balance import Layout, make_layout
from mmjax.training.pipeline.schedule import Schedule, expected_bubble, load_csv, make_schedule

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    schedule: Schedule
    layout: Layout


def check_microbatch_rows(cfg, axes: tuple[str, ...], sizes: list[int]) -> None:
    """With `pipeline_weight_gather=step` the executor splits each microbatch's rows over the batch `axes`
    itself: refuse a microbatch they do not divide, naming the batch size to use."""
    m = cfg.train.grad_accum_steps
    rows, ranks = cfg.train.global_batch_size // m, math.prod(sizes)
    if rows % ranks:
        raise ConfigError(f"a pipeline microbatch of {rows} rows (train.global_batch_size / train.grad_accum_steps) "
                          f"does not split over the {ranks} ranks of {'x'.join(axes)}; make "
                          f"train.global_batch_size a multiple of {m * ranks}")


def check_pipeline(cfg, p: int, report: bool = False) -> PipelinePlan:
    """Validate a pipeline of `p` ranks for `cfg` and return its plan; `report` logs the layout and expected
    bubble (a warning below 4p microbatches)."""
    par, m = cfg.parallel, cfg.train.grad_accum_steps
    v = par.pipeline_virtual_stages
    if v < 1:
        raise ConfigError(f"parallel.pipeline_virtual_stages={v} must be >= 1")
    if v > 1 and par.pipeline_schedule != "interleaved_1f1b" and not par.pipeline_schedule_file:
        raise ConfigError(f"parallel.pipeline_virtual_stages={v} needs parallel.pipeline_schedule=interleaved_1f1b")
    if m < p:
        raise ConfigError(f"train.grad_accum_steps={m} (the pipeline's microbatches) is below mesh.pipeline={p}; "
                          f"set train.grad_accum_steps >= {p} (>= {4 * p} keeps the bubble small)")
    if par.pipeline_schedule == "interleaved_1f1b" and m % p and not par.pipeline_schedule_file:
        raise ConfigError(f"interleaved_1f1b needs train.grad_accum_steps={m} divisible by mesh.pipeline={p}; "
                          f"use {-(-m // p) * p}")
    if not cfg.model.scan_layers:
        raise ConfigError("mesh.pipeline > 1 splits the stacked decoder layers; set model.scan_layers=true")
    for name, target in par.rules.items():
        targets = target if isinstance(target, list) else [target]
        if "pipeline" in targets:
            raise ConfigError(f"parallel.rules.{name} maps to `pipeline`, which the pipeline itself owns; "
                              "map it to another mesh axis")
    if par.pipeline_head_cost < 0:
        raise ConfigError(f"parallel.pipeline_head_cost={par.pipeline_head_cost} must be >= 0")
    batch_axes = tuple(a for a in spec_axes(rules_from_config(cfg).get("batch")) if a != "pipeline")
    sizes = [getattr(cfg.mesh, a, 1) for a in batch_axes]
    if par.pipeline_weight_gather == "step" and all(size > 0 for size in sizes):  # -1: checked at mesh build
        check_microbatch_rows(cfg, batch_axes, sizes)
    layout = make_layout(cfg.model.text.n_layers, p, v, par.pipeline_balance, par.pipeline_head_cost)
    if par.pipeline_schedule_file:  # a hand-made schedule (rows rank,tick,kind,chunk,micro), checked on load
        schedule = load_csv(par.pipeline_schedule_file, p, m, v)
    else:
        schedule = make_schedule(par.pipeline_schedule, p, m, v)
    if report:
        log.info("pipeline: %s over %d ranks x %d chunks, %d microbatches, stages of %s layers, %d ticks, "
                 "expected bubble %.1f%%, stash depth %d", schedule.name, p, v, m, list(layout.sizes),
                 schedule.num_ticks, 100 * schedule.bubble_fraction(), schedule.stash_depth())
    if report and m < 4 * p:
        log.warning("train.grad_accum_steps=%d microbatches over mesh.pipeline=%d ranks: expected bubble %.0f%% "
                    "of the step; >= %d microbatches bring it below %.0f%%", m, p, 100 * expected_bubble(p, m, v),
                    4 * p, 100 * expected_bubble(p, 4 * p, v))
    return PipelinePlan(schedule, layout)
