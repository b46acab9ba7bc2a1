"""The draft model inside the target's verifying step (`serve.speculative.method=draft` with
`proposer_on_device`): greedy tokens equal plain greedy decoding and the unfused draft proposer's, a sampled
request draws the same tokens as with the unfused proposer (the draws use the same keys), each request's drafted
and accepted counts equal the unfused path's, also with adaptive k, dynamic speculation (the draft catches up
after plain steps) and preemption; nothing compiles after warm-up; a speculative step is one device call once
the draft has caught up; bad settings are refused."""

import itertools

import numpy as np
import pytest
from spec_cases import SPEC_PROMPTS, IdsTokenizer  # this folder's shared cases (pytest puts it on the path)

from mmjax.config import Config, ServeConfig, SpeculativeConfig
from mmjax.serving.engine import Engine
from mmjax.serving.request import SamplingParams
from mmjax.serving.speculative.proposers import DraftProposer, FusedDraftProposer

PROMPTS = SPEC_PROMPTS
MAX_TOKENS = 14



@pytest.fixture(scope="module")
def lm(draft_lm):
    """The shared target and noisy draft, and the target's greedy outputs of PROMPTS (the plain forward)."""
    return dict(draft_lm, want=[draft_lm["ref"].greedy(p, MAX_TOKENS, stop=()) for p in PROMPTS])


def _engine(lm, fused, warmup=True, num_pages=80, max_num_seqs=8, launch_thread=False, **spec):
    serve = ServeConfig(page_size=4, num_pages=num_pages, max_num_batched_tokens=32, max_num_seqs=max_num_seqs,
                        min_token_bucket=32, min_slot_bucket=max_num_seqs, max_model_len=40, max_logprobs=0,
                        launch_thread=launch_thread,
                        speculative=SpeculativeConfig(method="draft", num_tokens=3, proposer_on_device=fused, **spec))
    return Engine(Config(model=lm["model"].cfg, serve=serve), lm["model"], IdsTokenizer(), warmup=warmup,
                  draft_model=lm["draft"])


def _run(engine, prompts, params):
    """Every request's final output, in prompt order."""
    ids = [engine.add_request(p, sampling_params=sp) for p, sp in zip(prompts, params)]
    final = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
    return [final[rid] for rid in ids]


def _counts(outs):
    return [(o.metrics.num_draft_tokens, o.metrics.num_accepted_tokens) for o in outs]


def _check_done(engine):
    engine.kv.check_consistency()
    assert engine.kv.num_free_pages == engine.kv.num_usable_pages
    engine.proposer._release_stale()  # the draft's pages return at its next proposal
    assert engine.proposer.kv.num_free_pages == engine.proposer.kv.num_usable_pages


def _count_catch_ups(engine):
    """Per proposing step: the requests the draft's own step ran for (its catch-up)."""
    steps, propose, forward = [], engine.proposer.propose, engine.proposer.runner.forward

    def counted_propose(requests):
        steps.append(set())
        return propose(requests)

    def counted_forward(entries, seeds):
        steps[-1].update(e[0].request_id for e in entries)
        return forward(entries, seeds)
    engine.proposer.propose, engine.proposer.runner.forward = counted_propose, counted_forward
    return steps


MIXED = [SamplingParams(max_tokens=MAX_TOKENS)] * len(PROMPTS)
SAMPLED = [SamplingParams(max_tokens=8, temperature=0.9, seed=3),
           SamplingParams(max_tokens=8, temperature=0.7, top_k=5, seed=11)]  # the sort program too


def test_fused_draft_equals_unfused_draft_and_plain_greedy(lm):
    """Greedy tokens equal plain greedy and the unfused draft proposer's, sampled requests in the same steps draw
    the same tokens as with it, drafted and accepted counts are equal per request (some drafts rejected, some
    accepted), nothing compiles after warm-up (target or draft), and after its first speculative step (the
    draft's catch-up over the prompt) each request's steps make one device call; every page returns."""
    prompts, params = [*PROMPTS, [1, 9, 9], [1, 17, 40]], [*MIXED, *SAMPLED]
    unfused = _engine(lm, fused=False, warmup=False)
    assert isinstance(unfused.proposer, DraftProposer)
    want = _run(unfused, prompts, params)
    eng = _engine(lm, fused=True)
    assert isinstance(eng.proposer, FusedDraftProposer)
    compiles, draft_compiles = eng.runner.num_compiles, eng.proposer.runner.num_compiles
    catch_ups = _count_catch_ups(eng)
    got = _run(eng, prompts, params)
    assert [o.token_ids for o in got[:len(PROMPTS)]] == lm["want"] == [o.token_ids for o in want[:len(PROMPTS)]]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(len(o.token_ids) == 8 for o in got[len(PROMPTS):])
    logprobs = lambda outs: [s.logprob for o in outs for s in o.logprobs]  # noqa: E731
    np.testing.assert_allclose(logprobs(got), logprobs(want), rtol=1e-4, atol=1e-5)
    assert _counts(got) == _counts(want)
    assert sum(a for _, a in _counts(got)) > 0 and any(d > a for d, a in _counts(got))
    st = eng.stats()
    assert st["spec_draft_tokens"] == sum(d for d, _ in _counts(got))
    assert st["spec_accepted_tokens"] == sum(a for _, a in _counts(got))
    assert eng.runner.num_compiles == compiles and eng.proposer.runner.num_compiles == draft_compiles
    # the draft's own step ran only to catch up over each prompt, in the request's first speculative step: every
    # later step of it is the one fused call
    ran = [rid for step in catch_ups for rid in step]
    assert sorted(ran) == sorted(o.request_id for o in got)
    assert sum(not step for step in catch_ups) > len(catch_ups) // 2
    _check_done(eng)


def test_fused_draft_with_adaptive_and_dynamic_speculation(lm):
    """Adaptive k (reserved slots vary per request) and dynamic speculation switching between plain (overlapped)
    steps and speculative ones (the draft catches up over the plain steps' tokens first): greedy tokens equal
    plain greedy and the counts equal the unfused path's under the same choices; nothing compiles after warm-up.
    The fused engine makes its calls on the launcher thread (the draft's pools come back with the target's
    from a call that may still run there). The policy's choices are replaced by a fixed cycle (its own depend
    on measured times)."""
    outs = {}
    for fused in (False, True):
        eng = _engine(lm, fused=fused, adaptive=True, dynamic=True, launch_thread=fused)
        choices = itertools.cycle([0, 0, 3, 3, 0, 2, 1, 3])
        eng.policy.choose = lambda request_ids, c=choices: next(c)
        compiles = eng.runner.num_compiles
        outs[fused] = _run(eng, PROMPTS, MIXED)
        assert eng.runner.num_compiles == compiles
        st = eng.stats()
        assert st["spec_steps"] > 0 and st["spec_plain_calls"] > 0
        _check_done(eng)
    assert [o.token_ids for o in outs[True]] == lm["want"] == [o.token_ids for o in outs[False]]
    assert _counts(outs[True]) == _counts(outs[False])
    assert sum(a for _, a in _counts(outs[True])) > 0


def test_fused_draft_through_preemption(tiny, lm):
    """A pool too small for every request at once: requests are preempted while speculating (their draft KV is
    dropped with them) and recompute; greedy tokens still equal plain greedy; every page returns."""
    n = 24
    want = [tiny["reference"](lm["model"], size=40).greedy(p, n, stop=()) for p in PROMPTS]
    eng = _engine(lm, fused=True, warmup=False, num_pages=24, max_num_seqs=4)
    assert [o.token_ids for o in _run(eng, PROMPTS, [SamplingParams(max_tokens=n)] * len(PROMPTS))] == want
    assert eng.stats()["num_preemptions"] > 0 and eng.stats()["spec_accepted_tokens"] > 0
    _check_done(eng)


def test_fused_draft_needs_a_matching_draft(tiny, lm):
    """A draft of another vocabulary is refused when it is attached."""
    other = tiny["model"](tiny["config"](text_only=True, vocab_size=48), seed=1)
    with pytest.raises(ValueError, match="vocabulary"):
        _engine(dict(lm, draft=other), fused=True, warmup=False)


@pytest.mark.parametrize("overrides, message", [
    (["serve.speculative.proposer_on_device=true"], "needs serve.speculative.method=ngram or draft"),
    (["serve.speculative.method=draft", "serve.speculative.proposer_on_device=1"], "must be bool")])
def test_proposer_on_device_with_draft_config(overrides, message):
    from mmjax.config import load_config
    from mmjax.errors import ConfigError
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
    spec = load_config(None, ["serve.speculative.method=draft", "serve.speculative.proposer_on_device=true"]
                       ).serve.speculative
    assert spec.method == "draft" and spec.proposer_on_device
