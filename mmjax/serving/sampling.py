"""Batched token sampling for the serving engine: penalties, greedy/temperature, top-k, top-p, min-p, logprobs.

One row per sequence slot, fixed shapes per (slots, history length) bucket, so one compiled `sample` serves
every step. Each row draws from its own key `fold_in(key(seed), step)`: a seeded request gets the same tokens
whatever else is in the batch, whichever slot it sits in, and after a preemption recomputes them exactly.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mmjax.serving.request import Request, RequestError, StepRequestError

PAD_ID = -1  # padding in the token-history arrays


@flax.struct.dataclass
class SamplingTensors:
    """Per-slot sampling parameters and token history (`S` slots, history length `L`); empty slots are
    greedy rows without penalties and their results are ignored.

    `prompt_ids`/`output_ids` are `PAD_ID`-padded; only requests with a penalty fill them (the others'
    rows stay padding), so `L` only has to cover the penalised requests (see `history_len`).
    """

    temperature: jax.Array  # f32[S]; 0 = greedy
    top_k: jax.Array  # i32[S]; 0 = off
    top_p: jax.Array  # f32[S]; 1 = off
    min_p: jax.Array  # f32[S]; 0 = off
    repetition_penalty: jax.Array  # f32[S]; 1 = off
    presence_penalty: jax.Array  # f32[S]
    frequency_penalty: jax.Array  # f32[S]
    seed: jax.Array  # u32[S]
    step: jax.Array  # i32[S]: tokens the request has generated so far
    prompt_ids: jax.Array  # i32[S, L]
    output_ids: jax.Array  # i32[S, L]
    # static (part of the compiled program's key): whether any row needs the top-k/top-p sort. A device-side
    # branch instead would make the GPU wait for the host to read its predicate in every token step.
    sort: bool = flax.struct.field(pytree_node=False, default=False)
    # static too: K, the most likely tokens `sample` returns per row with their logprobs (0: none, no top-k pass)
    top_logprobs: int = flax.struct.field(pytree_node=False, default=0)

    @classmethod
    def from_requests(cls, requests: Sequence[Request | None], num_slots: int, max_len: int, *,
                      seeds: Mapping[str, int] | None = None, top_logprobs: int = 0) -> SamplingTensors:
        """Host-side (numpy) tensors; `requests[i]` fills row `i`, `None` leaves a slot empty.

        `seeds` maps the id of each request without `sampling_params.seed` to the seed the engine drew for
        it once (from its own seeded RNG), so unseeded requests are reproducible for a seeded engine too.
        `max_len` (`L`) must be >= `history_len` of the penalised requests. The sort (top-k / top-p) is
        compiled in when a row needs it or the history is non-empty (`full_sampler_history` picks one of the
        two programs a runner compiles: plain, or penalties and sort). `top_logprobs` is K (the runner's full
        program returns them, its plain one none).
        """
        if len(requests) > num_slots:
            raise RequestError(f"{len(requests)} requests do not fit num_slots={num_slots}")
        f32 = functools.partial(np.full, num_slots, dtype=np.float32)
        temperature, top_p, min_p = f32(0.0), f32(1.0), f32(0.0)
        repetition, presence, frequency = f32(1.0), f32(0.0), f32(0.0)
        top_k = np.zeros(num_slots, np.int32)
        seed = np.zeros(num_slots, np.uint32)
        step = np.zeros(num_slots, np.int32)
        prompt_ids = np.full((num_slots, max_len), PAD_ID, np.int32)
        output_ids = np.full((num_slots, max_len), PAD_ID, np.int32)
        for i, req in enumerate(requests):
            if req is None:
                continue
            try:
                sp = req.sampling_params
                temperature[i], top_k[i], top_p[i], min_p[i] = sp.temperature, sp.top_k, sp.top_p, sp.min_p
                repetition[i], presence[i], frequency[i] = (sp.repetition_penalty, sp.presence_penalty,
                                                            sp.frequency_penalty)
                step[i] = len(req.output_token_ids)
                if sp.seed is not None:
                    seed[i] = sp.seed & 0xFFFFFFFF
                elif not sp.greedy:
                    if seeds is None or req.request_id not in seeds:
                        raise RequestError(f"request {req.request_id!r} has no sampling seed; pass the seed the "
                                           "engine drew for it in seeds={request_id: seed}")
                    seed[i] = seeds[req.request_id] & 0xFFFFFFFF
                if sp.uses_penalties:
                    n_prompt, n_out = len(req.prompt_token_ids), len(req.output_token_ids)
                    if max(n_prompt, n_out) > max_len:
                        raise RequestError(f"request {req.request_id!r}: {n_prompt} prompt / {n_out} output tokens "
                                           f"exceed the sampler's history max_len={max_len}; size it with "
                                           "history_len(requests)")
                    prompt_ids[i, :n_prompt] = req.prompt_token_ids
                    output_ids[i, :n_out] = req.output_token_ids
            except (OverflowError, ValueError, TypeError) as e:  # a value the int32/f32 arrays cannot hold
                raise StepRequestError(req.request_id, f"its sampling parameters do not fit the sampler's "
                                       f"arrays: {e}") from e
        sort = max_len > 0 or any(r is not None and r.sampling_params.needs_sort for r in requests)
        return cls(temperature, top_k, top_p, min_p, repetition, presence, frequency, seed, step,
                   prompt_ids, output_ids, sort, top_logprobs)


def history_len(requests: Sequence[Request | None]) -> int:
    """The history length `L` the penalised requests need (0 when none uses a penalty); the caller rounds
    it up to a bucket to bound recompiles."""
    return max((max(r.num_prompt_tokens, len(r.output_token_ids)) for r in requests
                if r is not None and r.sampling_params.uses_penalties), default=0)


def full_sampler_history(requests: Sequence[Request | None], max_len: int, top_logprobs: bool = True) -> int:
    """The history length a runner's step samples with: `max_len` (the full program: penalties, the top-k/top-p
    sort and the top-K logprobs) when a request uses a penalty, needs the sort or (with `top_logprobs`, for a
    program that returns them) wants its most likely tokens, else 0 (the plain program: greedy, temperature,
    min-p). Two programs per step shape, both compiled at warm-up; a batch of plain requests pays for none of it."""
    full = any(r is not None and (r.sampling_params.uses_penalties or r.sampling_params.needs_sort
                                  or (top_logprobs and r.sampling_params.needs_top_logprobs)) for r in requests)
    return max_len if full else 0


@flax.struct.dataclass
class SampleResult:
    """Sampled tokens and logprobs. Logprobs are log-softmax of the raw logits (before penalties and
    temperature), as vLLM returns by default: they describe the model, not the sampling settings."""

    tokens: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S]: the chosen token's logprob
    top_ids: jax.Array  # i32[S, K], most likely first (K = SamplingTensors.top_logprobs, maybe 0)
    top_logprobs: jax.Array  # f32[S, K]


def _counts(ids: jax.Array, vocab: int) -> jax.Array:
    """i32[S, V] occurrences of each token in the PAD_ID-padded rows of `ids` (built on device)."""
    rows = jnp.arange(ids.shape[0])[:, None]
    idx = jnp.where(ids < 0, vocab, ids)  # padding -> out of range -> dropped
    return jnp.zeros((ids.shape[0], vocab), jnp.int32).at[rows, idx].add(1, mode="drop")


def apply_penalties(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """Repetition penalty over prompt + output tokens, then presence and frequency over output tokens."""
    vocab = logits.shape[-1]
    out_counts = _counts(t.output_ids, vocab)
    seen = (_counts(t.prompt_ids, vocab) > 0) | (out_counts > 0)
    rep = t.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return (logits - t.presence_penalty[:, None] * (out_counts > 0)
            - t.frequency_penalty[:, None] * out_counts.astype(logits.dtype))


def _top_k_top_p_mask(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask (-inf) tokens outside each row's top-k, then outside its top-p nucleus. One descending sort;
    ties with the cut-off value are kept."""
    vocab = logits.shape[-1]
    desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)
    desc = jnp.where(jnp.arange(vocab)[None, :] < k[:, None], desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly more likely tokens
    # top_p >= 1 keeps everything outright: rounding in the cumsum must not cut an unrestricted row's tail
    keep = ((before < top_p[:, None]) | (top_p[:, None] >= 1.0)).at[:, 0].set(True)
    p_cut = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits < jnp.maximum(kth, p_cut), -jnp.inf, logits)


def top_k(x: jax.Array, k: int, chunk: int = 512) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k` over the last axis of f32[S, V] (same values and indices; ties: lower index first),
    without a top-k pass over the whole row: GPU top-k runs one thread block per row, slow over a 128k
    vocabulary. Instead: each `chunk`-wide slice's maximum (a plain reduction), the k slices with the largest
    maxima (they hold the top k), then top-k over those k slices only."""
    s, v = x.shape
    n = -(-v // chunk)
    if n <= 2 * k:
        return jax.lax.top_k(x, k)
    best = jnp.pad(x, ((0, 0), (0, n * chunk - v)), constant_values=-jnp.inf).reshape(s, n, chunk).max(axis=-1)
    # slices in index order, so that ties among the candidates still resolve to the lower index
    slices = jnp.sort(jax.lax.top_k(best, k)[1], axis=-1)
    cols = (slices[:, :, None] * chunk + jnp.arange(chunk, dtype=slices.dtype)).reshape(s, k * chunk)
    cand = jnp.where(cols < v, jnp.take_along_axis(x, jnp.minimum(cols, v - 1), axis=1), -jnp.inf)
    vals, pos = jax.lax.top_k(cand, k)
    return vals, jnp.take_along_axis(cols, pos, axis=1)


def _row_keys(seed: jax.Array, step: jax.Array) -> jax.Array:
    # threefry named explicitly: its per-key streams do not depend on the batch (vmap) around them.
    return jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s, impl="threefry2x32"), n))(seed, step)


def filtered_logits(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """f32[N, V] logits the sampler draws from: divided by the temperature (greedy rows left as they are),
    masked to top-k, top-p and min-p (-inf outside)."""
    greedy = t.temperature <= 0.0
    scaled = logits / jnp.where(greedy, 1.0, t.temperature)[:, None]
    if t.sort:
        scaled = _top_k_top_p_mask(scaled, t.top_k, t.top_p)
    # min-p: keep p >= min_p * p_max, i.e. logit >= max + log(min_p) (masking above does not change the max)
    floor = jnp.max(scaled, axis=-1, keepdims=True) + jnp.log(t.min_p)[:, None]
    return jnp.where(scaled < floor, -jnp.inf, scaled)


@jax.jit
def sample(logits: jax.Array, t: SamplingTensors) -> SampleResult:
    """One token per row of `logits` f32[S, V].

    Penalties, then: greedy rows (temperature 0) take the argmax of the penalised logits; the others divide by
    temperature, mask to top-k, top-p and min-p, and draw with their row key. The top-K logprobs (K =
    `t.top_logprobs`, static) are computed only when K > 0; else they come back with 0 columns.
    """
    logits = logits.astype(jnp.float32)
    penalised = apply_penalties(logits, t)
    greedy = t.temperature <= 0.0
    scaled = filtered_logits(penalised, t)
    drawn = jax.vmap(jax.random.categorical)(_row_keys(t.seed, t.step), scaled)
    tokens = jnp.where(greedy, jnp.argmax(penalised, axis=-1), drawn).astype(jnp.int32)

    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    if t.top_logprobs > 0:
        top_logprobs, top_ids = top_k(logprobs, t.top_logprobs)
    else:
        top_logprobs = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return SampleResult(tokens, chosen, top_ids.astype(jnp.int32), top_logprobs)
