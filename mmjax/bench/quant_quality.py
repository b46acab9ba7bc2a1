"""Quality of a quantization scheme against the unquantized model: logits, perplexity and greedy output.

`logit_report` runs the training forward (text only) over held-out token sequences with the float and the
quantized weights: max / mean |logit difference|, top-1 agreement and each side's perplexity. `greedy_report`
generates greedily through the serving engine (quantized weights and KV pool as served) and compares the tokens
with the float engine's, position by position and whole sequences.

The reference variant `bf16` (every parameter rounded to bfloat16, computed as before) is no quantization
scheme: it is the noise floor of these metrics, what a perturbation as small as bfloat16 weights already moves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.config import Config
from mmjax.quant.apply import parse_variant, quantize_state, weight_bytes
from mmjax.serving.engine import LLM
from mmjax.serving.request import SamplingParams


class LogitForward:
    """Jitted text-only forward of one model graph over [B, S] token batches; one compile per weight tree."""

    def __init__(self, graphdef: Any) -> None:
        self._fwd = jax.jit(lambda st, tokens, positions, segments: nnx.merge(graphdef, st)(
            tokens, positions, segments))

    def __call__(self, state: Any, tokens: np.ndarray) -> np.ndarray:
        b, s = tokens.shape
        positions = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
        return np.asarray(self._fwd(state, jnp.asarray(tokens, jnp.int32), positions, np.ones((b, s), np.int32)))


def perplexity(logits: np.ndarray, tokens: np.ndarray, mask: np.ndarray | None = None) -> float:
    """exp(mean next-token NLL) over the targets tokens[:, 1:] where `mask` [B, S] (default all) is set."""
    logp = jax.nn.log_softmax(jnp.asarray(logits[:, :-1], jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, jnp.asarray(tokens[:, 1:, None]), axis=-1)[..., 0]
    weight = jnp.ones_like(nll) if mask is None else jnp.asarray(mask[:, 1:], jnp.float32)
    return float(jnp.exp(jnp.sum(nll * weight) / jnp.maximum(jnp.sum(weight), 1)))


def logit_report(forward: LogitForward, ref_state: Any, state: Any, tokens: np.ndarray,
                 ref_logits: np.ndarray | None = None, mask: np.ndarray | None = None) -> dict[str, float]:
    """Logit differences, top-1 agreement (all positions) and perplexities (over `mask`ed targets) of `state`
    against `ref_state` on `tokens` [B, S]."""
    ref = forward(ref_state, tokens) if ref_logits is None else ref_logits
    got = forward(state, tokens)
    diff = np.abs(got.astype(np.float32) - ref.astype(np.float32))
    return dict(max_logit_diff=float(diff.max()), mean_logit_diff=float(diff.mean()),
                top1_agreement=float(np.mean(got.argmax(-1) == ref.argmax(-1))),
                perplexity=perplexity(got, tokens, mask), ref_perplexity=perplexity(ref, tokens, mask))


BF16 = "bf16"  # the reference variant: parameters rounded to bfloat16, the compute dtype unchanged


def _to_bf16(x: Any) -> Any:
    return x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x


def bf16_rounded(state: Any) -> Any:
    """`state` with every floating parameter rounded to bfloat16 and kept in its dtype."""
    return jax.tree.map(lambda x: _to_bf16(x).astype(x.dtype), state)


def greedy_tokens(cfg: Config, model: Any, tokenizer: Any, prompts: Sequence[Sequence[int]], new_tokens: int,
                  **serve: Any) -> list[list[int]]:
    """Greedy outputs (EOS ignored) of the serving engine with `serve` keys overridden (quantization, KV dtype)."""

    run = dataclasses.replace(cfg, serve=dataclasses.replace(cfg.serve, **serve))
    outs = LLM(run, model, tokenizer).generate([list(p) for p in prompts],
                                               SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    return [list(o.token_ids) for o in outs]


def greedy_agreement(ref: Sequence[Sequence[int]], got: Sequence[Sequence[int]]) -> dict[str, float]:
    """Share of output positions with the reference's token, of whole outputs equal to it, and where outputs
    first differ (mean position, the output's length where equal; and how many differ at position 0): a
    precision loss shows as outputs that part and stay apart, a wrong token at one position as the same
    first position everywhere with the rest agreeing."""
    pos = [a == b for x, y in zip(ref, got, strict=True) for a, b in zip(x, y, strict=True)]
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(ref, got)]
    return dict(greedy_token_agreement=float(np.mean(pos)),
                greedy_sequence_agreement=float(np.mean([list(x) == list(y) for x, y in zip(ref, got)])),
                greedy_first_diff_mean=float(np.mean(first)),
                greedy_first_token_agreement=float(np.mean([f > 0 for f in first])))


def forced_greedy_agreement(forward: LogitForward, state: Any, prompts: Sequence[Sequence[int]],
                            ref: Sequence[Sequence[int]]) -> float:
    """Share of the reference's greedy tokens that `state`'s forward also ranks first when fed the reference's
    own prefix (teacher-forced): each generation step judged alone, so one flip does not carry on as it does in
    free-running greedy agreement. Weights only (the training forward has no KV pool)."""
    hits = []
    by_len: dict[int, list[list[int]]] = {}
    for p, r in zip(prompts, ref, strict=True):
        by_len.setdefault(len(p), []).append(list(p) + list(r))
    for plen, seqs in by_len.items():
        seq = np.asarray(seqs, np.int32)
        pred = forward(state, seq).argmax(-1)[:, plen - 1:-1]
        hits.append((pred == seq[:, plen:]).ravel())
    return float(np.mean(np.concatenate(hits)))


def evaluate(cfg: Config, model: Any, tokenizer: Any, tokens: np.ndarray, prompts: Sequence[Sequence[int]], *,
             schemes: Sequence[str], kv_dtypes: Sequence[str], new_tokens: int,
             mask: np.ndarray | None = None) -> list[dict[str, Any]]:
    """One row per (weight scheme, KV dtype): bytes, logit metrics (per scheme; perplexity over the `mask`ed
    targets of `tokens`), greedy agreement and teacher-forced greedy agreement (per scheme). A scheme may carry
    '+head' (the int8 output matmul too); `bf16` is the reference variant (see the module docstring)."""
    graphdef, state = nnx.split(model)
    forward = LogitForward(graphdef)
    ref_logits = forward(state, tokens)
    ref_greedy = greedy_tokens(cfg, model, tokenizer, prompts, new_tokens, quantization="none",
                               kv_cache_dtype="auto")
    rows = []
    for scheme in schemes:
        base, head = ("none", False) if scheme == BF16 else parse_variant(scheme)
        if scheme == BF16:
            qstate = bf16_rounded(state)
        else:
            qstate = quantize_state(state, base, lm_head=head, group=cfg.serve.quant_group)
        served = nnx.merge(graphdef, qstate) if scheme == BF16 else model
        nbytes = weight_bytes(jax.tree.map(_to_bf16, state) if scheme == BF16 else qstate)
        logits = logit_report(forward, state, qstate, tokens, ref_logits, mask)
        logits["greedy_forced_agreement"] = forced_greedy_agreement(forward, qstate, prompts, ref_greedy)
        for kv in kv_dtypes:
            row = dict(scheme=scheme, kv_cache_dtype=kv, weight_bytes=nbytes, **logits)
            got = ref_greedy if (scheme, kv) == ("none", "auto") else greedy_tokens(
                cfg, served, tokenizer, prompts, new_tokens, quantization=base, quantize_lm_head=head,
                kv_cache_dtype=kv)
            rows.append({**row, **greedy_agreement(ref_greedy, got)})
    return rows
