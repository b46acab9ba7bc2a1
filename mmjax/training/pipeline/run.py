"""The MLLM's train loss through a pipeline: placement of the model around the pipeline executor.

Vision tower, projector and token embeddings run before the pipeline as plain GSPMD; the decoder stack is
cut into stages (`training.pipeline.balance`); final norm, LM head and loss (`model.loss_impl`'s fused
cross-entropy unless it is `xla`) run in the last stage per microbatch and return token-loss sums, so the
train step's normalisation, loss scaling, ZeRO and optimizer are the same as without a pipeline. The train
state holds the layers in the [rank, chunk, slot] order the executor runs (`engine.stage_storage`;
checkpoints and evaluation see canonical order).
With `parallel.pipeline_weight_gather=step` (default) the batch axes are manual in the executor: FSDP
weights gathered once per step, gradients reduced over data x fsdp once per step (`BatchSplit`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from mmjax import kernels
from mmjax.model.decoder import RESIDUAL
from mmjax.model.layers import run_stack
from mmjax.parallel.rules import rules_from_config, spec_axes
from mmjax.parallel.sharding import constrain
from mmjax.parallel.zero import ShardingPlan
from mmjax.training.pipeline.executor import AXIS, BatchSplit, pipeline_loss
from mmjax.training.pipeline.plan import PipelinePlan, check_microbatch_rows, check_pipeline
from mmjax.training.steps import MODEL_INPUTS, loss_settings, split_micro_batches

LossFn = Callable[[nnx.Module, dict, jax.Array], tuple[jax.Array, jax.Array]]


def to_stages(layers: dict, plan: PipelinePlan) -> dict:
    """Stored [p * v * slots, ...] layer params (stage order, `engine.stage_storage`; canonical order when the
    stages are equal and contiguous) -> {"layers": [p, v, slots, ...], "active": [p, v, slots]}: a free
    reshape of the `pipeline`-sharded row axis."""
    lay = plan.layout
    _, active = lay.index()
    rows = lay.num_rows

    def view(a: jax.Array) -> jax.Array:
        if a.shape[0] != rows:
            raise ValueError(f"decoder layer stack of {a.shape[0]} rows; the pipeline layout {lay.sizes} stores "
                             f"{rows} (build the state with engine.init.model_setup, which converts)")
        return a.reshape(lay.p, lay.v, lay.slots, *a.shape[1:])

    return {"layers": jax.tree.map(view, layers), "active": jnp.asarray(active)}


def stage_spec(layer_spec: P) -> P:
    """The spec of a stacked stage leaf [p, v, slots, ...] from its canonical [L, ...] leaf's spec."""
    return P(AXIS, None, None, *tuple(layer_spec)[1:])


def batch_split(cfg, mesh, shardings: ShardingPlan) -> BatchSplit | None:
    """The executor's manual batch axes and the weight / gradient specs on them; None when the batch is not
    split (one data-parallel rank) or `parallel.pipeline_weight_gather=use` leaves the axes to GSPMD."""
    axes = tuple(a for a in spec_axes(rules_from_config(cfg).get("batch")) if mesh.shape.get(a, 1) > 1)
    if not axes or cfg.parallel.pipeline_weight_gather != "step":
        return None
    check_microbatch_rows(cfg, axes, [mesh.shape[a] for a in axes])  # a -1 mesh axis resolves only here

    def specs(tree: dict) -> tuple[dict, dict]:
        dec = tree["decoder"]
        head = {"norm": jax.tree.map(lambda s: s.spec, dec["final_norm"]),
                "w": (dec["embedding"] if dec.get("lm_head") is None else dec["lm_head"]).spec}
        stage = {"layers": jax.tree.map(lambda s: stage_spec(s.spec), dec["layers"]), "active": P(AXIS)}
        return stage, head

    stage_params, head_params = specs(shardings.params)
    stage_grads, head_grads = specs(shardings.grads)
    return BatchSplit(axes, stage_params, head_params, stage_grads, head_grads)


def make_pipeline_loss(cfg, mesh, shardings: ShardingPlan) -> LossFn:
    """loss(model, batch, scale) -> (token-loss sum, loss-token count) through the configured pipeline;
    `shardings` (the ZeRO plan) says where the weights and their gradients live."""
    plan = check_pipeline(cfg, mesh.shape["pipeline"], report=True)
    split = batch_split(cfg, mesh, shardings)
    m = cfg.train.grad_accum_steps
    ring = mesh.shape["sequence"] > 1 and cfg.parallel.context_parallel == "ring"

    def loss(model: nnx.Module, batch: dict, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
        dec = model.decoder
        x, block_ids = model.embed(*(batch.get(k) for k in MODEL_INPUTS[:1] + MODEL_INPUTS[3:]))
        micro = split_micro_batches({"x": x, "positions": batch["positions"], "segment_ids": batch["segment_ids"],
                                     "block_ids": block_ids, "targets": batch["targets"],
                                     "loss_mask": batch["loss_mask"].astype(jnp.float32)}, m)
        side = (micro["positions"], micro["segment_ids"], micro["block_ids"])
        layers_gd, layers_state = nnx.split(dec.layers)
        norm_gd, norm_state = nnx.split(dec.final_norm)
        w, layout = dec.output_matrix()
        loss_impl, chunk = loss_settings(model)

        def stage_fn(pc, h, side):
            positions, segment_ids, block_ids = side
            layers = nnx.merge(layers_gd, pc["layers"])

            def body(layer, h, active):  # a padding slot (uneven stages) skips its layer
                run = lambda h: layer(h, positions, segment_ids, block_ids)  # noqa: E731
                if ring:  # its permutes must run on every device: no branch that differs across ranks
                    return jnp.where(active > 0, run(h), h), None
                return jax.lax.cond(active > 0, run, lambda h: h, h), None

            h = constrain(h, RESIDUAL)
            return run_stack(layers, body, h, pc["active"], scan=True, remat_policy=dec.remat)[0]

        def head_fn(hp, h, loss_in):
            targets, mask = loss_in
            hidden = nnx.merge(norm_gd, hp["norm"])(h)
            count = jnp.sum(mask)
            if loss_impl != "xla":  # the fused linear cross-entropy, as in loss_sums: no [b, s, vocab] logits
                total = kernels.linear_cross_entropy(hidden, hp["w"], targets, mask, w_layout=layout, impl=loss_impl,
                                                     chunk=chunk)
                return total, count
            spec = "bse,ve->bsv" if layout == "ve" else "bse,ev->bsv"
            logits = jnp.einsum(spec, hidden, hp["w"].astype(dec.compute_dtype), preferred_element_type=jnp.float32)
            logits = constrain(logits, ("batch", "length", "vocab"))
            # cross-entropy with the target logit picked by a one-hot product: XLA's SPMD partitioner aborts
            # on the gather of take_along_axis inside a shard_map that leaves other mesh axes automatic
            picked = jnp.sum(jnp.where(jnp.arange(logits.shape[-1]) == targets[..., None], logits, 0.0), axis=-1)
            ce = jax.nn.logsumexp(logits, axis=-1) - picked
            return jnp.sum(ce * mask), count

        f = pipeline_loss(plan.schedule, stage_fn, head_fn, mesh, masked=ring, split=split)
        stage_params = to_stages(layers_state.to_pure_dict(), plan)
        head_params = {"norm": norm_state.to_pure_dict(), "w": w}
        return f(stage_params, head_params, micro["x"], side, (micro["targets"], micro["loss_mask"]),
                 jnp.asarray(scale, jnp.float32))

    return loss
