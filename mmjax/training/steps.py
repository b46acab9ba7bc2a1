"""The jitted train step: loss over micro-batches, gradient accumulation, loss scaling, AdamW update."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from mmjax import kernels
from mmjax.training.precision import all_finite
from mmjax.training.state import TrainState

Batch = dict[str, jax.Array]
MODEL_INPUTS = ("tokens", "positions", "segment_ids", "images", "image_valid")


def loss_settings(model: nnx.Module) -> tuple[str, int | None]:
    """(model.loss_impl, the cross-entropy's chunk or None for automatic); a model without a config: xla."""
    cfg = getattr(model, "cfg", None)
    return getattr(cfg, "loss_impl", "xla"), getattr(cfg, "loss_chunk_tokens", 0) or None


def loss_sums(model: nnx.Module, batch: Batch) -> tuple[jax.Array, jax.Array]:
    """(sum of masked token cross-entropies, number of loss tokens); float32 whatever the compute dtype."""
    loss_impl, chunk = loss_settings(model)
    # a decoder-only model (model.text_only, e.g. a converted Llama) ignores the loader's empty image slots
    inputs = MODEL_INPUTS[:3] if getattr(model, "text_only", False) else MODEL_INPUTS
    if loss_impl != "xla" and hasattr(model, "hidden"):
        # Fused linear cross-entropy (kernels.cross_entropy): no [B, S, vocab] logits in memory.
        hidden = model.hidden(*(batch.get(k) for k in inputs))
        w, layout = model.output_matrix()
        mask = batch["loss_mask"].astype(jnp.float32)
        total = kernels.linear_cross_entropy(hidden, w, batch["targets"], mask, w_layout=layout, impl=loss_impl,
                                              chunk=chunk)
        return total, jnp.sum(mask)
    logits = model(*(batch.get(k) for k in inputs))
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"])
    mask = batch["loss_mask"].astype(jnp.float32)
    return jnp.sum(ce * mask), jnp.sum(mask)


def nonfinite_counts(loss: jax.Array, grads: Any) -> tuple[jax.Array, jax.Array]:
    """(NaN count, Inf count) over the loss and every gradient element (float32: exact below 2^24)."""
    leaves = [loss, *jax.tree.leaves(grads)]
    nan = sum(jnp.sum(jnp.isnan(x), dtype=jnp.float32) for x in leaves)
    inf = sum(jnp.sum(jnp.isinf(x), dtype=jnp.float32) for x in leaves)
    return nan, inf


def split_micro_batches(batch: Batch, accum_steps: int) -> Batch:
    """[B, ...] -> [accum, B/accum, ...], taking rows strided so each device's rows stay local."""

    def split(x: jax.Array) -> jax.Array:
        b = x.shape[0]
        return x.reshape(b // accum_steps, accum_steps, *x.shape[1:]).swapaxes(0, 1)

    return jax.tree.map(split, batch)


def make_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule, accum_steps: int,
                    skip_nonfinite: bool = True, grad_shardings: Any = None,
                    pipeline_loss: Callable | None = None) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
    """Build `train_step(state, batch) -> (state, metrics)`; jit it with donated state.

    Gradients are of the *sum* of token losses, divided once by the total token count, so any
    accumulation split gives the same update as one big batch. `skip_nonfinite=False`
    (`observe.nan_policy=warn`) applies updates even when gradients are not finite; fp16 loss scaling
    always skips them. `grad_shardings` (the ZeRO plan's) pins where gradients live, e.g.
    reduce-scattered over the data-parallel group for ZeRO-2. `pipeline_loss(model, batch, scale)`
    (`engine.pipeline`) replaces `loss_sums` when the mesh has a pipeline: it runs the `accum_steps`
    microbatches itself, so the step takes one gradient of the whole batch.
    """

    def scaled_loss(params: Any, batch: Batch, scale: jax.Array):
        model = nnx.merge(graphdef, params)
        total, count = loss_sums(model, batch) if pipeline_loss is None else pipeline_loss(model, batch, scale)
        return total * scale, (total, count)

    def grad_fn(params: Any, batch: Batch, scale: jax.Array):
        grads, aux = jax.grad(scaled_loss, has_aux=True)(params, batch, scale)
        if grad_shardings is not None:
            grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
        return grads, aux

    def gradients(params: Any, batch: Batch, scale: jax.Array):
        if accum_steps == 1 or pipeline_loss is not None:
            grads, (total, count) = grad_fn(params, batch, scale)
            return grads, total, count
        micro = split_micro_batches(batch, accum_steps)

        def body(carry, mb):
            g_acc, t_acc, c_acc = carry
            g, (t, c) = grad_fn(params, mb, scale)
            return (jax.tree.map(jnp.add, g_acc, g), t_acc + t, c_acc + c), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        if grad_shardings is not None:  # the accumulator lives where the gradients do (a shard for ZeRO-2)
            zeros = jax.lax.with_sharding_constraint(zeros, grad_shardings)
        (grads, total, count), _ = jax.lax.scan(body, (zeros, 0.0, 0.0), micro)
        return grads, total, count

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        scale = state.loss_scale.scale
        grads, total, count = gradients(state.params, batch, scale)
        denom = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: (g / (scale * denom)).astype(jnp.float32), grads)
        loss = total / denom
        nan_count, inf_count = nonfinite_counts(loss, grads)
        finite = all_finite(grads)
        grad_norm = optax.global_norm(grads)
        updates, new_opt = optimizer.update(grads, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        # A step with non-finite gradients (fp16 overflow, or a bad batch) leaves params untouched.
        guard = finite if (skip_nonfinite or state.loss_scale.dynamic) else jnp.asarray(True)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(guard, n, o), new, old)
        new_state = state.replace(
            step=state.step + 1,
            params=keep(new_params, state.params),
            opt_state=keep(new_opt, state.opt_state),
            loss_scale=state.loss_scale.update(finite),
        )
        metrics = {
            "train/loss": loss,
            "train/grad_norm": grad_norm,
            # optax's own count skips non-finite steps, so the rate in use is at step - skipped
            "train/lr": schedule(state.step - state.loss_scale.skipped),
            "train/loss_tokens": count,
            "train/tokens": jnp.sum(batch["segment_ids"] > 0),
            "train/loss_scale": scale,
            "train/skipped_steps": new_state.loss_scale.skipped,
            # for train/mfu (mmjax.observe.flops): causal (query, key) pairs = sum(position + 1) per token
            "train/attention_pairs": jnp.sum(jnp.where(batch["segment_ids"] > 0, batch["positions"] + 1, 0)
                                             .astype(jnp.float32)),
            "train/images": (jnp.sum(batch["image_valid"]).astype(jnp.float32) if "image_valid" in batch
                             else jnp.zeros((), jnp.float32)),
            "health/nan_count": nan_count,
            "health/inf_count": inf_count,
        }
        return new_state, metrics

    return train_step
