"""A finished call's outputs (host numpy, as `PackedStep.outputs` returns them) as each request's sampled tokens.

One reader per kind of call: a single step (`step_tokens`, with its verified drafts), a multi-step or mixed call
(`multi_step_tokens`, [K, S] per output) and a call of speculative rounds (`rounds_tokens`, [R, S]). Each turns
only the rows its entries use into Python values: the host pays for this every step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mmjax.serving.scheduler import ScheduledRequest
from mmjax.serving.speculative.device_ngram import DeviceHistory
from mmjax.serving.step_types import RequestState, SampledToken


def wants_top(entry: ScheduledRequest, requests: Mapping[str, RequestState]) -> bool:
    """Whether a scheduled entry's caller reads its top-k candidates: a request asking for top logprobs, or a
    beam search's row (its candidates). Such a request made its call the sampler's full program, which returns
    them; the plain program's top-k outputs have no columns."""
    return requests[entry.owner or entry.request_id].request.sampling_params.needs_top_logprobs


def step_tokens(outputs: Sequence[np.ndarray], scheduled: Sequence[ScheduledRequest],
                requests: Mapping[str, RequestState], history: DeviceHistory | None) -> dict[str, SampledToken]:
    """The tokens of a single step (`StepPrograms.ragged_step` or `decode_step`): one per sampling entry, or
    the tokens it emitted for an entry with drafts. `history`: the token histories on the device, told how far
    each speculating request's row is now written."""
    tokens, logprobs, top_ids, top_lp, *spec = outputs
    tokens, logprobs, spec = tokens.tolist(), logprobs.tolist(), [x.tolist() for x in spec]
    result = {}
    for i, entry in enumerate(scheduled):
        if not entry.samples or (entry.owner or entry.request_id) not in requests:
            continue  # nothing sampled, or finished since the step was launched
        if entry.num_draft:
            emitted, count, lps = spec[0][i], spec[1][i], spec[2][i]
            drafted = entry.num_draft
            if history is not None:  # proposed on the device: at most the reserved slots
                drafted = spec[3][i]
                history.wrote(entry.request_id, entry.start + entry.num_tokens - entry.num_draft + count)
            result[entry.request_id] = SampledToken(emitted[0], lps[0], tokens=tuple(emitted[:count]),
                                                    token_logprobs=tuple(lps[:count]), num_draft=drafted)
            continue
        if wants_top(entry, requests):  # only these rows' top-k become Python lists
            result[entry.request_id] = SampledToken(tokens[i], logprobs[i], tuple(top_ids[i].tolist()),
                                                    tuple(top_lp[i].tolist()))
        else:
            result[entry.request_id] = SampledToken(tokens[i], logprobs[i])
    return result


def multi_step_tokens(outputs: Sequence[np.ndarray], scheduled: Sequence[ScheduledRequest],
                      requests: Mapping[str, RequestState]) -> dict[str, SampledToken]:
    """The tokens of a multi-step or mixed call: each sampling entry's `num_steps` tokens, with their top-k."""
    # one host conversion per output (Python lists, [K, S] and [K, S, top]); top lists only for rows that use them
    tokens, logprobs, top_ids, top_lp = (x.tolist() for x in outputs)
    result = {}
    for i, entry in enumerate(scheduled):
        if not entry.samples:  # a mixed call's prefill chunk that does not end its prompt
            continue
        k = entry.num_steps
        toks, lps = tuple(tokens[j][i] for j in range(k)), tuple(logprobs[j][i] for j in range(k))
        ids = tops = ((),) * k
        if wants_top(entry, requests):
            ids = tuple(tuple(top_ids[j][i]) for j in range(k))
            tops = tuple(tuple(top_lp[j][i]) for j in range(k))
        result[entry.request_id] = SampledToken(toks[0], lps[0], ids[0], tops[0], tokens=toks, token_logprobs=lps,
                                                token_top_ids=ids, token_top_logprobs=tops)
    return result


def rounds_tokens(outputs: Sequence[Any], scheduled: Sequence[ScheduledRequest], requests: Mapping[str, RequestState],
                  history: DeviceHistory | None, num_rounds: int) -> dict[str, SampledToken]:
    """The tokens of a call of `num_rounds` speculative rounds: each entry's tokens of every round that ran for
    it, and each round's (drafts made, tokens emitted); `history` (n-gram rounds) is told how far each row is now
    written."""
    emitted, count, lps, found = (x.tolist() for x in outputs)
    result = {}
    for i, entry in enumerate(scheduled):
        rid = entry.request_id
        if rid not in requests:
            continue  # finished since the call was launched
        tokens: list[int] = []
        logprobs: list[float] = []
        sizes = []
        for r in range(num_rounds):
            c = count[r][i]
            if not c:  # the slot reached its limit: no later round ran for it
                break
            tokens += emitted[r][i][:c]
            logprobs += lps[r][i][:c]
            sizes.append((found[r][i], c))
        if history is not None:
            history.wrote(rid, entry.start + 1 + len(tokens))
        result[rid] = SampledToken(tokens[0], logprobs[0], tokens=tuple(tokens), token_logprobs=tuple(logprobs),
                                   num_draft=sum(d for d, _ in sizes), rounds=tuple(sizes))
    return result
