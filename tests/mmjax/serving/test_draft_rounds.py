"""Speculative rounds of the draft model in one device call (`serve.speculative.method=draft` with
`proposer_on_device` and `rounds` > 1): on a mixed stream (prompts of different lengths, a stop token and
max_tokens reached in the middle of a call, a request arriving while others run, sampled requests with fixed
seeds) every request's tokens, logprobs and drafted / accepted counts equal one round per call (`draft_device`,
the same draft keys per round) and greedy tokens equal plain greedy decoding; calls of rounds run every round;
nothing compiles after warm-up; every page of the target and the draft returns; the draft pages cover every
position a call may write."""

import pytest

# this folder's shared cases (pytest puts the folder on the path)
from spec_cases import SPEC_PROMPTS, IdsTokenizer, assert_rounds_equal_one_round, rounds_stream, watch_rounds

from mmjax.config import Config, ServeConfig, SpeculativeConfig
from mmjax.serving.request import SamplingParams

ROUNDS = 4
PROMPTS = SPEC_PROMPTS


def _engine(draft_lm, rounds, adaptive=True, warmup=True):
    from mmjax.serving.engine import Engine
    serve = ServeConfig(page_size=4, num_pages=80, max_num_batched_tokens=32, max_num_seqs=4, min_token_bucket=32,
                        min_slot_bucket=4, max_model_len=40, max_logprobs=0, decode_steps=1,
                        speculative=SpeculativeConfig(method="draft", num_tokens=3, adaptive=adaptive,
                                                      proposer_on_device=True, rounds=rounds))
    return Engine(Config(model=draft_lm["model"].cfg, serve=serve), draft_lm["model"], IdsTokenizer(), warmup=warmup,
                  draft_model=draft_lm["draft"])


def _run(engine, prompts, params, late):
    """Every request's final output and logprobs, in order; `late` (prompt, params) is added after two steps."""
    ids = [engine.add_request(p, sampling_params=sp) for p, sp in zip(prompts, params)]
    final, logprobs, steps = {}, {}, 0
    while engine.has_unfinished():
        steps += 1
        if steps == 3:
            ids.append(engine.add_request(late[0], sampling_params=late[1]))
        for o in engine.step():
            logprobs.setdefault(o.request_id, []).extend(lp.logprob for lp in o.logprobs)
            if o.finished:
                final[o.request_id] = o
    return [(final[rid], logprobs[rid]) for rid in ids]


def test_draft_rounds_equal_one_round_per_call_and_plain_greedy(draft_lm):
    """Four sequence slots for eight requests (and one arriving later): while requests wait, steps run a single
    round; once none waits, calls of four rounds. Greedy tokens equal plain greedy; every request's tokens (the
    sampled ones too), logprobs and counts equal `draft_device`'s one round per call."""
    ref = draft_lm["ref"]
    prompts, params, want = rounds_stream([ref.greedy(p, 14, stop=()) for p in PROMPTS])
    late = ([1, 7, 8, 7, 8, 7], SamplingParams(max_tokens=64))  # to the model's length, mid-call
    outs, lps = {}, {}
    for rounds in (1, ROUNDS):
        eng = _engine(draft_lm, rounds)
        compiles, draft_compiles, seen = eng.runner.num_compiles, eng.proposer.runner.num_compiles, []
        watch_rounds(eng, seen)
        outs[rounds], lps[rounds] = zip(*_run(eng, prompts, params, late))
        assert eng.runner.num_compiles == compiles and eng.proposer.runner.num_compiles == draft_compiles
        eng.kv.check_consistency()
        assert eng.kv.num_free_pages == eng.kv.num_usable_pages
        eng.proposer._release_stale()  # the draft's pages return at its next proposal
        assert eng.proposer.kv.num_free_pages == eng.proposer.kv.num_usable_pages
        if rounds > 1:
            assert seen and max(seen) == ROUNDS  # calls that ran every round for some request
    many = outs[ROUNDS]
    assert [o.token_ids for o in many[2:8]] == want
    assert many[-1].token_ids == ref.greedy(late[0], 64, stop=())
    assert_rounds_equal_one_round(outs[1], many, lps[1], lps[ROUNDS])


def test_draft_pages_cover_a_call_of_rounds(draft_lm):
    """With rounds the proposer's draft pages reach every position a call of rounds may write (up to its last
    known position + rounds x (k + 1) - 1, within max_tokens and the model's length), and it passes each
    request's k for the first round."""
    eng = _engine(draft_lm, ROUNDS, warmup=False)
    for prompt, n in (([1, 5, 6, 7], 30), ([1, 2, 3], 6)):
        eng.add_request(prompt, sampling_params=SamplingParams(max_tokens=n))
    eng.step()  # the prompts
    k = eng.proposer.k
    drafts = eng.proposer.propose(eng.scheduler.running)
    assert drafts.first_k == {r.request_id: k for r in eng.scheduler.running}
    long, short = eng.scheduler.running
    assert len(drafts.tables[long.request_id]) == eng.proposer.kv.pages_for(long.num_tokens + ROUNDS * (k + 1) - 1)
    assert len(drafts.tables[short.request_id]) == eng.proposer.kv.pages_for(short.num_tokens + 5 - 1)


@pytest.mark.parametrize("overrides, ok", [
    (["serve.speculative.method=draft", "serve.speculative.proposer_on_device=true", "serve.speculative.rounds=4"],
     True),
    (["serve.speculative.method=draft", "serve.speculative.rounds=4"], False)])
def test_draft_rounds_config(overrides, ok):
    from mmjax.config import load_config
    from mmjax.errors import ConfigError
    if ok:
        assert load_config(None, overrides).serve.speculative.rounds == 4
        return
    with pytest.raises(ConfigError, match="needs serve.speculative.method=ngram or draft with proposer_on_device"):
        load_config(None, overrides)


def test_bench_methods_map_to_valid_speculative_settings():
    """`bench_serving --spec-methods draft_rounds --spec-rounds R` is the draft model on the device with R rounds
    per call, as `ngram_rounds` is for the lookup; every benchmark method's settings validate."""
    from mmjax.bench.spec import DRAFT_METHODS, METHODS, method_config
    got = {m: method_config(SpeculativeConfig(), m, rounds=8, num_tokens=2) for m in METHODS}
    for cfg in got.values():
        cfg.validate()
    assert {m: (c.method, c.proposer_on_device, c.rounds) for m, c in got.items()} == {
        "none": ("none", False, 1), "ngram": ("ngram", False, 1), "ngram_device": ("ngram", True, 1),
        "ngram_rounds": ("ngram", True, 8), "draft": ("draft", False, 1), "draft_device": ("draft", True, 1),
        "draft_rounds": ("draft", True, 8)}
    assert set(DRAFT_METHODS) == {m for m, c in got.items() if c.method == "draft"}


def test_draft_rounds_through_preemption_on_the_launcher_thread(draft_lm):
    """A pool too small for every request's reserved rounds at once: requests are preempted (their draft KV
    dropped with them) and recompute; calls run on the launcher thread (the draft's pools come back with the
    target's from there). Greedy tokens still equal plain greedy; every page returns."""
    from mmjax.serving.engine import Engine
    n, prompts = 16, PROMPTS[:4]
    want = [draft_lm["ref"].greedy(p, n, stop=()) for p in prompts]
    serve = ServeConfig(page_size=4, num_pages=16, max_num_batched_tokens=32, max_num_seqs=4, min_token_bucket=32,
                        min_slot_bucket=4, max_model_len=40, max_logprobs=0, decode_steps=1, launch_thread=True,
                        speculative=SpeculativeConfig(method="draft", num_tokens=3, proposer_on_device=True,
                                                      rounds=ROUNDS))
    eng = Engine(Config(model=draft_lm["model"].cfg, serve=serve), draft_lm["model"], IdsTokenizer(),
                 draft_model=draft_lm["draft"])
    seen = []
    watch_rounds(eng, seen)
    ids = [eng.add_request(p, sampling_params=SamplingParams(max_tokens=n)) for p in prompts]
    final = {}
    while eng.has_unfinished():
        final.update((o.request_id, o) for o in eng.step() if o.finished)
    assert [final[rid].token_ids for rid in ids] == want
    assert eng.stats()["num_preemptions"] > 0 and seen and max(seen) > 1
    eng.kv.check_consistency()
    assert eng.kv.num_free_pages == eng.kv.num_usable_pages
    eng.proposer._release_stale()
    assert eng.proposer.kv.num_free_pages == eng.proposer.kv.num_usable_pages
