"""Distilling a draft model for speculative decoding: the draft (the target's first layers, `first_layers_draft`)
learns the frozen target's next-token distributions on sequences the target wrote (`distill_data`).

The loss is the forward KL(target || draft) at every position of the rows, the teacher's logits computed on the
fly by the target in the same jitted step. What speculation needs is that the draft's top-1 token is the
target's (greedy verification accepts exactly those), so the held-out metric is that top-1 agreement at the
positions that predict generated tokens. `save_draft` writes the draft as a params-only checkpoint that
`serve.speculative.draft_checkpoint` loads.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mmjax.checkpoint.convert import NP_DTYPES, save_params_checkpoint, save_tokenizer_files
from mmjax.config import Config
from mmjax.errors import ConfigError
from mmjax.serving.speculative.self_draft import first_layers_draft
from mmjax.training.distill_data import Sequences
from mmjax.training.optimizer import make_optimizer

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DistillSpec:
    steps: int = 600
    batch: int = 32  # rows per step
    lr: float = 1e-3  # peak learning rate (AdamW)
    warmup: int = 50  # linear warmup steps, then cosine decay to lr * min_lr_ratio
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    clip: float = 1.0  # global gradient norm
    eval_every: int = 50  # held-out metrics every this many steps (0: only before and after)
    freeze_embeddings: bool = False  # keep the embedding table (and a tied head) as the target's
    seed: int = 0

    def validate(self) -> None:
        for name in ("steps", "batch"):
            if getattr(self, name) < 1:
                raise ConfigError(f"distillation {name}={getattr(self, name)} must be >= 1")
        if not self.lr > 0:
            raise ConfigError(f"distillation lr={self.lr} must be > 0")
        if self.warmup < 0 or self.eval_every < 0:
            raise ConfigError("distillation warmup and eval_every must be >= 0")


def init_draft(cfg: Config, target: Any, num_layers: int) -> tuple[Config, Any]:
    """(draft config, draft MLLM): the target's first `num_layers` layers with its embedding, final norm and head,
    its parameters in float32 for training (the optimizer's updates are too small for bfloat16)."""
    f32 = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, param_dtype="float32"))
    draft = first_layers_draft(f32, target, num_layers)
    return dataclasses.replace(f32, model=draft.cfg), draft


def optimizer(spec: DistillSpec, params: Any) -> optax.GradientTransformation:
    """The training runs' optimizer (`make_optimizer`: clipping, AdamW with warmup + cosine decay, weight decay on
    matrices only) with the spec's settings; with `freeze_embeddings` the embedding table gets no update."""
    base = Config()
    optim = dataclasses.replace(base.optim, lr=spec.lr, warmup_steps=min(spec.warmup, spec.steps - 1),
                                schedule="cosine", min_lr_ratio=spec.min_lr_ratio, weight_decay=spec.weight_decay,
                                clip_grad_norm=spec.clip, b2=0.999, fused=False)
    adamw = make_optimizer(dataclasses.replace(base, optim=optim,
                                               train=dataclasses.replace(base.train, steps=spec.steps)))
    if not spec.freeze_embeddings:
        return adamw
    labels = jax.tree_util.tree_map_with_path(
        lambda path, _: "frozen" if any("embedding" in str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        else "train", params)
    return optax.multi_transform({"train": adamw, "frozen": optax.set_to_zero()}, labels)


def _inputs(tokens: jax.Array, lengths: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(positions, segment ids, valid mask) of zero-padded rows: padding is segment 0 at position 0."""
    valid = jnp.arange(tokens.shape[1])[None] < lengths[:, None]
    positions = jnp.where(valid, jnp.arange(tokens.shape[1])[None], 0).astype(jnp.int32)
    return positions, valid.astype(jnp.int32), valid


def forward_kl(teacher_logits: jax.Array, student_logits: jax.Array) -> jax.Array:
    """KL(teacher || student) per position [B, S], in float32."""
    p_log = jax.nn.log_softmax(teacher_logits.astype(jnp.float32), axis=-1)
    q_log = jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.exp(p_log) * (p_log - q_log), axis=-1)


class Distiller:
    """The jitted train and eval steps of a draft against a frozen target."""

    def __init__(self, target: Any, draft: Any, spec: DistillSpec) -> None:
        spec.validate()
        self.spec = spec
        self.target_graphdef, self.target_state = nnx.split(target)
        self.graphdef, params, self.rest = nnx.split(draft, nnx.Param, ...)
        # its own buffers: a draft cut from the target may share arrays with it, and the step donates these
        self.params = jax.tree.map(jnp.copy, params)
        self.tx = optimizer(spec, self.params)
        self.opt_state = self.tx.init(self.params)
        self._train = jax.jit(self._train_step, donate_argnums=(0, 1))
        self._eval = jax.jit(self._eval_step)

    def _teacher(self, target_state: Any, tokens: jax.Array, positions: jax.Array, segments: jax.Array) -> jax.Array:
        logits = nnx.merge(self.target_graphdef, target_state)(tokens, positions, segments)
        return jax.lax.stop_gradient(logits)

    def _train_step(self, params, opt_state, target_state, tokens, lengths):
        positions, segments, valid = _inputs(tokens, lengths)
        teacher = self._teacher(target_state, tokens, positions, segments)

        def loss_fn(p):
            student = nnx.merge(self.graphdef, p, self.rest)(tokens, positions, segments)
            kl = forward_kl(teacher, student)
            return jnp.sum(kl * valid) / jnp.maximum(jnp.sum(valid), 1)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def _eval_step(self, params, target_state, tokens, lengths, generated):
        positions, segments, valid = _inputs(tokens, lengths)
        student = nnx.merge(self.graphdef, params, self.rest)(tokens, positions, segments)
        teacher = self._teacher(target_state, tokens, positions, segments)
        agree = jnp.argmax(student, -1) == jnp.argmax(teacher, -1)
        kl = forward_kl(teacher, student)
        return (jnp.sum(kl * valid), jnp.sum(valid), jnp.sum(agree * generated), jnp.sum(generated),
                jnp.sum(agree * valid))

    def train_step(self, tokens: np.ndarray, lengths: np.ndarray) -> float:
        self.params, self.opt_state, loss = self._train(self.params, self.opt_state, self.target_state,
                                                        jnp.asarray(tokens), jnp.asarray(lengths))
        return float(loss)

    def evaluate(self, seqs: Sequences, batch: int) -> dict[str, float]:
        """Held-out metrics over `seqs` in batches of `batch` rows (the last one padded with empty rows): mean KL
        per token, top-1 agreement with the target at the positions predicting generated tokens
        (`agreement`) and at every position (`agreement_all`)."""
        sums = np.zeros(5)
        generated = seqs.generated()
        for start in range(0, len(seqs), batch):
            rows = np.arange(start, start + batch)
            real = rows < len(seqs)
            rows = np.where(real, rows, 0)
            tokens, lengths = seqs.tokens[rows], np.where(real, seqs.lengths[rows], 0)
            gen = generated[rows] & real[:, None]
            sums += np.asarray([float(x) for x in self._eval(self.params, self.target_state, jnp.asarray(tokens),
                                                             jnp.asarray(lengths), jnp.asarray(gen))])
        kl, n, agree, n_gen, agree_all = sums
        return {"kl": kl / max(n, 1), "agreement": agree / max(n_gen, 1), "agreement_all": agree_all / max(n, 1),
                "tokens": int(n), "generated_tokens": int(n_gen)}

    def draft_params(self) -> dict:
        """The draft's parameters as a nested dict of numpy arrays (`nnx.to_pure_dict`)."""
        return jax.tree.map(np.asarray, nnx.to_pure_dict(self.params))


def distill(target: Any, draft: Any, train: Sequences, held_out: Sequences, spec: DistillSpec,
            log_fn: Callable[[dict], None] | None = None) -> tuple[Distiller, dict[str, Any]]:
    """Train `draft` on `train` against `target` for `spec.steps` steps of `spec.batch` rows (shuffled, epoch after
    epoch); returns the distiller (its `params` are the trained draft's) and a summary: held-out metrics before,
    every `eval_every` steps and after, and the training loss of every step. `log_fn` gets each record."""
    if len(train) == 0 or len(held_out) == 0:
        raise ConfigError(f"distillation needs training and held-out rows (got {len(train)} and {len(held_out)})")
    d = Distiller(target, draft, spec)
    emit = log_fn or (lambda r: log.info("%s", r))
    rng = np.random.default_rng(spec.seed)
    history: list[dict] = []
    before = d.evaluate(held_out, spec.batch)
    emit({"step": 0, **{f"held_out_{k}": v for k, v in before.items()}})
    order, at = rng.permutation(len(train)), 0
    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(1, spec.steps + 1):
        rows = []
        while len(rows) < spec.batch:  # a batch may wrap into the next epoch's order
            take = order[at:at + spec.batch - len(rows)]
            rows.extend(take.tolist())
            at += len(take)
            if at >= len(order):
                order, at = rng.permutation(len(train)), 0
        loss = d.train_step(train.tokens[rows], train.lengths[rows])
        losses.append(loss)
        if spec.eval_every and step % spec.eval_every == 0 and step < spec.steps:
            m = d.evaluate(held_out, spec.batch)
            record = {"step": step, "loss": loss, "seconds": time.perf_counter() - t0,
                      **{f"held_out_{k}": v for k, v in m.items()}}
            history.append(record)
            emit(record)
    train_seconds = time.perf_counter() - t0
    after = d.evaluate(held_out, spec.batch)
    emit({"step": spec.steps, "loss": losses[-1], **{f"held_out_{k}": v for k, v in after.items()}})
    summary = {"spec": dataclasses.asdict(spec), "train_rows": len(train), "held_out_rows": len(held_out),
               "train_tokens": int(train.lengths.sum()), "before": before, "after": after, "evals": history,
               "loss": losses, "train_seconds": train_seconds}
    return d, summary


def save_draft(out: str | Path, draft_cfg: Config, params: dict, *, dtype: str,
               tokenizer: str | Path | None = None, **meta: Any) -> Path:
    """Write the draft as a params-only mmjax checkpoint `out/0` (its model config with `dtype` parameters),
    with the target's tokenizer files (`tokenizer`: its tokenizer.json or a folder holding one) under
    `out/tokenizer` when given; `meta` adds keys to its meta. Returns the checkpoint folder (what
    `serve.speculative.draft_checkpoint` takes)."""
    model = dataclasses.replace(draft_cfg.model, param_dtype=dtype, text_only=True)
    params = jax.tree.map(lambda x: np.asarray(x).astype(NP_DTYPES[dtype]), params)
    save_params_checkpoint(out, params, Config(model=model), **meta)
    if tokenizer is not None:
        save_tokenizer_files(tokenizer, Path(out) / "tokenizer")
    return Path(out)
