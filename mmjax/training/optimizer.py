"""optax AdamW with warmup + decay schedules and global-norm clipping, built from `cfg.optim`."""

from __future__ import annotations

import jax
import optax

from mmjax.config import Config
from mmjax.training.buckets import bucketed, decayed_buckets


def learning_rate_schedule(cfg: Config) -> optax.Schedule:
    """Linear warmup to `optim.lr`, then cosine / polynomial decay to `lr * min_lr_ratio`, or constant.

    Its length is `optim.schedule_steps` (default `train.steps`), so a finished run can be continued to
    more steps without changing the learning rate it already saw.
    """
    o = cfg.optim
    total = o.schedule_steps or cfg.train.steps
    warmup = min(o.warmup_steps, total)
    decay_steps = max(total - warmup, 1)
    end = o.lr * o.min_lr_ratio
    if o.schedule == "cosine":
        decay = optax.cosine_decay_schedule(o.lr, decay_steps, alpha=o.min_lr_ratio)
    elif o.schedule == "polynomial":
        decay = optax.polynomial_schedule(o.lr, end, o.power, decay_steps)
    else:
        decay = optax.constant_schedule(o.lr)
    if warmup == 0:
        return decay
    ramp = optax.linear_schedule(o.lr / warmup, o.lr, warmup)
    return optax.join_schedules([ramp, decay], [warmup])


def resumed_schedule_warning(saved: dict, cfg: Config, step: int) -> str | None:
    """What to warn when a run resumed at `step` follows another learning-rate schedule than the run that wrote
    the checkpoint (`saved`: its resolved config) because train.steps changed while optim.schedule_steps stayed
    0 (the schedule's length follows train.steps); None when the schedule is the same or set on purpose."""
    if cfg.optim.schedule_steps:
        return None
    before = (saved.get("optim") or {}).get("schedule_steps") or (saved.get("train") or {}).get("steps")
    now = cfg.train.steps
    if not isinstance(before, int) or before == now:
        return None
    if cfg.optim.schedule == "constant" and cfg.optim.warmup_steps <= min(step, before, now):
        return None  # past the warmup a constant schedule does not depend on its length
    return (f"the checkpoint's run had a learning-rate schedule of {before} steps, this one has {now} "
            f"(train.steps={now}, optim.schedule_steps=0), so from step {step} on the learning rate is not the one "
            f"that run would have used; set optim.schedule_steps={before} to keep its schedule")


def _decay_mask(params):
    """Weight decay on matrices only: norms, biases and other vectors are not decayed. A scanned (stacked) layer
    stack's leaves carry a leading layer axis that does not count, so scanned and unrolled layers (and the
    pipeline's stage-ordered stack) decay the same parameters."""
    return jax.tree_util.tree_map_with_path(lambda path, p: p.ndim - _stacked(path) >= 2, params)


def _stacked(path: tuple) -> bool:
    """Whether a leaf at `path` sits in a stacked layer stack: under a `layers` node whose children are not the
    numbered layers of an unrolled stack."""
    names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    return any(n == "layers" and i + 1 < len(names) and not names[i + 1].isdigit() for i, n in enumerate(names))


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with the run's schedule; `optim.fused`: the same over a few flat
    buckets of parameters (`training.buckets`) instead of leaf by leaf."""
    o = cfg.optim

    def chain(mask) -> optax.GradientTransformation:
        parts = [optax.clip_by_global_norm(o.clip_grad_norm)] if o.clip_grad_norm > 0 else []
        parts.append(optax.adamw(learning_rate_schedule(cfg), b1=o.b1, b2=o.b2, eps=o.eps,
                                 weight_decay=o.weight_decay, mask=mask))
        return optax.chain(*parts)

    return bucketed(chain(decayed_buckets), _decay_mask) if o.fused else chain(_decay_mask)
