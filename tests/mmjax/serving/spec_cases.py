"""What the speculative-decoding tests share: prompts with repeats, a tokenizer that decodes ids as numbers, the
rounds tests' mixed stream and their comparison with one round per call."""

import numpy as np

from mmjax.serving.request import SamplingParams

# prompts with repeats, where an n-gram lookup or a draft model has something to find (the speculation tests)
SPEC_PROMPTS = [[1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 20, 21, 22, 20, 21, 22, 20], [1, 9, 9, 9, 9, 9],
                [1, 30, 31, 30, 31, 30, 31, 30, 31, 30, 31], [1, 2, 3, 4, 2, 3, 4], [1, 44, 13, 50]]


class IdsTokenizer:
    """Decodes ids as their numbers and has no EOS: tests that compare token ids only."""

    eos_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def first_new(tokens, start):
    """An index >= start whose token does not occur before it (a stop token that ends the output there)."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def rounds_stream(greedy):
    """The speculative-rounds tests' stream from SPEC_PROMPTS' greedy outputs (14 tokens each): two seeded
    sampled requests first, then SPEC_PROMPTS with max_tokens that end some mid-call and the second stopped by a
    stop token mid-call. Returns (prompts, params, want): want is what greedy decoding gives SPEC_PROMPTS' ones."""
    stop_at = first_new(greedy[1], 5)
    limits = (14, 14, 7, 14, 9, 5)
    prompts = [[1, 9, 9], [1, 30, 31, 30, 31], *SPEC_PROMPTS]
    params = [SamplingParams(max_tokens=12, temperature=0.9, seed=3),
              SamplingParams(max_tokens=10, temperature=1.1, top_k=5, seed=11)] + \
        [SamplingParams(max_tokens=n, stop_token_ids=[greedy[1][stop_at]] if i == 1 else [])
         for i, n in enumerate(limits)]
    want = [g[:n] for g, n in zip(greedy, limits)]
    want[1] = greedy[1][:stop_at + 1]
    return prompts, params, want


def assert_rounds_equal_one_round(one, many, lps_one, lps_many):
    """A stream of `rounds_stream` plus one request run to the model's length: with rounds, every request's
    finish reason, tokens (the sampled ones too), logprobs and drafted / accepted counts equal one round per call,
    and some drafts were accepted and some rejected."""
    assert [o.finish_reason for o in many] == [*["length"] * 3, "stop", *["length"] * 5]
    assert [o.token_ids for o in many] == [o.token_ids for o in one]
    assert len(many[0].token_ids) == 12 and len(many[1].token_ids) == 10
    for a, b in zip(lps_one, lps_many):
        np.testing.assert_allclose(b, a, atol=1e-4)
    counts = [(o.metrics.num_draft_tokens, o.metrics.num_accepted_tokens) for o in many]
    assert counts == [(o.metrics.num_draft_tokens, o.metrics.num_accepted_tokens) for o in one]
    assert sum(a for _, a in counts) > 0 and any(d > a for d, a in counts)


def watch_rounds(engine, seen):
    """Record in `seen`, per call of speculative rounds, the most rounds any request ran in it."""
    collect = engine.runner.collect

    def watched(pending):
        sampled = collect(pending)
        if pending.rounds:
            seen.append(max((len(s.rounds) for s in sampled.values()), default=0))
        return sampled
    engine.runner.collect = watched
