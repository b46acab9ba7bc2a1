"""Speculative rounds in one device call (`serve.speculative.rounds`, the n-gram proposer on the device): the
tokens, logprobs, finish reasons and drafted / accepted counts of every request equal one round per call (the
verifying step) and greedy tokens equal plain greedy decoding, with a stop token, max_tokens and the model's
length reached in the middle of a call, sampled requests (their keys are those of separate speculative steps),
adaptive k and preemption in a small pool; nothing compiles after warm-up; bad settings are refused."""

import pytest

# this folder's shared cases (pytest puts the folder on the path)
from spec_cases import SPEC_PROMPTS, IdsTokenizer, assert_rounds_equal_one_round, rounds_stream, watch_rounds

from mmjax.config import Config, ServeConfig, SpeculativeConfig

ROUNDS = 4
REPETITIVE = SPEC_PROMPTS


def _run(engine, prompts, params):
    """Every request's final output, in prompt order, with the logprobs of all its tokens."""
    ids = [engine.add_request(p, sampling_params=sp) for p, sp in zip(prompts, params)]
    final, logprobs = {}, {rid: [] for rid in ids}
    while engine.has_unfinished():
        for o in engine.step():
            logprobs[o.request_id] += [lp.logprob for lp in o.logprobs]
            if o.finished:
                final[o.request_id] = o
    return [(final[rid], logprobs[rid]) for rid in ids]


def _engine(model, rounds, *, num_pages=80, max_num_seqs=8, adaptive=True):
    from mmjax.serving.engine import Engine
    serve = ServeConfig(page_size=4, num_pages=num_pages, max_num_batched_tokens=32, max_num_seqs=max_num_seqs,
                        min_token_bucket=32, min_slot_bucket=max_num_seqs, max_model_len=40, max_logprobs=0,
                        decode_steps=1, speculative=SpeculativeConfig(
                            method="ngram", num_tokens=3, adaptive=adaptive, proposer_on_device=True, rounds=rounds))
    return Engine(Config(model=model.cfg, serve=serve), model, IdsTokenizer(), warmup=True)


@pytest.fixture(scope="module")
def lm(tiny):
    model = tiny["model"](tiny["config"](text_only=True), seed=3)
    return dict(model=model, ref=tiny["reference"](model, size=40))


def test_rounds_equal_one_round_and_plain_greedy(lm):
    """Four sequence slots for nine requests: while requests wait, steps run a single round (with each request's
    adaptive k, which the sampled requests, arriving first, lower), then calls of rounds once none waits."""
    from mmjax.serving.request import SamplingParams
    ref = lm["ref"]
    prompts, params, want = rounds_stream([ref.greedy(p, 14, stop=()) for p in REPETITIVE])
    prompts, params = [*prompts, [1, 9, 9, 9, 9, 9]], [*params, SamplingParams(max_tokens=64)]  # to the length
    want_last = ref.greedy(prompts[-1], 64, stop=())
    outs, lps = {}, {}
    for rounds in (1, ROUNDS):
        eng = _engine(lm["model"], rounds, max_num_seqs=4)
        compiles, seen = eng.runner.num_compiles, []
        watch_rounds(eng, seen)
        outs[rounds], lps[rounds] = zip(*_run(eng, prompts, params))
        assert eng.runner.num_compiles == compiles
        eng.kv.check_consistency()
        assert eng.kv.num_free_pages == eng.kv.num_usable_pages
        if rounds > 1:
            assert seen and max(seen) == ROUNDS  # calls that ran every round for some request
            assert eng.runner.history.num_uploads == len(prompts)  # each row went up once
    many = outs[ROUNDS]
    assert [o.token_ids for o in many[2:8]] == want and many[-1].token_ids == want_last
    assert_rounds_equal_one_round(outs[1], many, lps[1], lps[ROUNDS])


def test_rounds_without_adaptive_k_through_preemption(lm):
    """A pool too small for every request's reserved rounds at once: requests are preempted and recompute;
    greedy tokens still equal plain greedy and every page returns."""
    from mmjax.serving.request import SamplingParams
    n = 24
    want = [lm["ref"].greedy(p, n, stop=()) for p in REPETITIVE]
    eng = _engine(lm["model"], ROUNDS, num_pages=24, max_num_seqs=4, adaptive=False)
    compiles, seen = eng.runner.num_compiles, []
    watch_rounds(eng, seen)
    outs = _run(eng, REPETITIVE, [SamplingParams(max_tokens=n)] * len(REPETITIVE))
    assert [o.token_ids for o, _ in outs] == want
    assert eng.stats()["num_preemptions"] > 0 and seen and max(seen) > 1
    assert eng.stats()["spec_accepted_tokens"] > 0
    assert eng.runner.num_compiles == compiles
    eng.kv.check_consistency()
    assert eng.kv.num_free_pages == eng.kv.num_usable_pages


def test_reserved_draft_slots_of_a_single_round_and_of_a_call_of_rounds():
    """With rounds and adaptive k: a step that runs a single round (a request waits to be admitted) reserves the
    request's adaptive k slots, as without rounds; a call of rounds reserves num_tokens slots (its rounds may
    draft more) and pages for every token it may emit; the proposer passes the adaptive k the first round uses."""
    from mmjax.serving.kv_manager import KVCacheManager
    from mmjax.serving.request import Request, SamplingParams
    from mmjax.serving.scheduler import Scheduler
    from mmjax.serving.speculative.proposers import DeviceNgramProposer
    proposer = DeviceNgramProposer(SpeculativeConfig(method="ngram", num_tokens=3, adaptive=True,
                                                     proposer_on_device=True, rounds=ROUNDS))
    kv = KVCacheManager(64, 4)
    sched = Scheduler(kv, max_num_batched_tokens=32, max_num_seqs=2, max_model_len=40, spec_rounds=ROUNDS,
                      spec_draft_slots=3)
    a = Request("a", [1, 2, 3, 4], SamplingParams(max_tokens=20))
    sched.add_request(a)
    sched.update_from_output(sched.schedule(), {"a": 7})  # the prompt
    proposer.propose([a])
    a.num_draft_tokens = 3  # a round that accepted none of its 3 drafts: k drops to 2
    sched.add_request(Request("b", [5, 6], SamplingParams(max_tokens=20)))
    assert proposer.propose(sched.running) == {"a": 2}
    out = sched.schedule()  # b can be admitted: a single round beside its prompt
    assert [(e.request_id, e.num_rounds, e.num_draft) for e in out.scheduled] == [("a", 1, 2), ("b", 1, 0)]
    sched.update_from_output(out, {"a": [8], "b": 9}, num_drafts={"a": 0})
    proposer.propose(sched.running)
    out = sched.schedule()  # every running request speculates and none waits: a call of rounds
    got = [(e.num_rounds, e.num_draft, len(e.token_ids), e.emit_limit) for e in out.scheduled]
    assert got == [(ROUNDS, 3, 4, 16)] * 2
    assert all(len(e.page_ids) == kv.pages_for(e.start + 16) for e in out.scheduled)


@pytest.mark.parametrize("overrides, message", [
    (["serve.speculative.method=ngram", "serve.speculative.proposer_on_device=true", "serve.speculative.rounds=0"],
     "must be in"),
    (["serve.speculative.method=ngram", "serve.speculative.rounds=2"],
     "needs serve.speculative.method=ngram or draft with proposer_on_device"),
    (["serve.speculative.method=none", "serve.speculative.rounds=2"],
     "needs serve.speculative.method=ngram or draft with proposer_on_device")])
def test_rounds_config_is_validated(overrides, message):
    from mmjax.config import load_config
    from mmjax.errors import ConfigError
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
    assert load_config(None, ["serve.speculative.method=ngram", "serve.speculative.proposer_on_device=true",
                              "serve.speculative.rounds=4"]).serve.speculative.rounds == 4


def test_dynamic_speculation_prices_a_call_of_rounds_per_round(lm):
    """With `dynamic` and rounds: greedy tokens still equal plain greedy, nothing compiles after warm-up, calls of
    rounds run, and the policy records a speculative step's time per round (the call's time over its rounds) and
    one acceptance try per round, so a request's acceptance stays a fraction (a call's tokens taken as one step's
    would give more accepted tokens than proposals)."""
    from mmjax.serving.engine import Engine
    from mmjax.serving.request import SamplingParams
    n = 16
    want = [lm["ref"].greedy(p, n, stop=()) for p in REPETITIVE[:4]]
    serve = ServeConfig(page_size=4, num_pages=80, max_num_batched_tokens=32, max_num_seqs=4, min_token_bucket=32,
                        min_slot_bucket=4, max_model_len=40, max_logprobs=0, decode_steps=1,
                        speculative=SpeculativeConfig(method="ngram", num_tokens=3, proposer_on_device=True,
                                                      rounds=ROUNDS, dynamic=True, dynamic_probe_every=4))
    eng = Engine(Config(model=lm["model"].cfg, serve=serve), lm["model"], IdsTokenizer(), warmup=True)
    compiles, seen, spec = eng.runner.num_compiles, [], []
    watch_rounds(eng, seen)
    record_spec, record_acceptance = eng.policy.record_spec, eng.policy.record_acceptance
    eng.policy.record_spec = lambda n, k, s: (spec.append(s), record_spec(n, k, s))
    tries = []
    eng.policy.record_acceptance = lambda rid, k, a: (tries.append((k, a)), record_acceptance(rid, k, a))
    outs = _run(eng, REPETITIVE[:4], [SamplingParams(max_tokens=n)] * 4)
    assert [o.token_ids for o, _ in outs] == want
    assert eng.runner.num_compiles == compiles
    assert seen and max(seen) > 1  # calls of rounds ran
    assert spec and tries and all(0 <= a <= k for k, a in tries)  # one try per round: at most k accepted
    assert all(0 <= eng.policy.acceptance(f"req-{i}") <= 1 for i in range(4))
    eng.kv.check_consistency()
    assert eng.kv.num_free_pages == eng.kv.num_usable_pages


def test_speculative_bench_runs_the_rounds_method(tiny):
    """`bench_serving --mode speculative --spec-methods ngram_rounds`: the method runs speculative rounds (fewer
    engine steps than one round per call, the same acceptance) and compiles nothing while timed."""
    from mmjax.bench import spec as bench_spec
    cfg = Config(model=tiny["config"](text_only=True),
                 serve=ServeConfig(page_size=4, num_pages=64, max_num_batched_tokens=16, max_num_seqs=4,
                                   min_token_bucket=16, min_slot_bucket=4, max_logprobs=0, decode_steps=1))
    spec = bench_spec.SpecBenchSpec(batches=(2,), prompt_len=16, new_tokens=12, num_tokens=2, rounds=3,
                                    repeat_block=4, beam_batch=1, num_beams=2, repeats=2)
    rows = bench_spec.run_spec_bench(cfg, spec, methods=("ngram_device", "ngram_rounds"))["speculation"]
    one = {r["workload"]: r for r in rows if r["method"] == "ngram_device"}
    for r in (r for r in rows if r["method"] == "ngram_rounds"):
        assert r["compiles_during_timing"] == 0 and r["tokens"] == one[r["workload"]]["tokens"]
        assert len(r["tok_s_runs"]) == 2 and r["tok_s"] == pytest.approx(sum(r["tok_s_runs"]) / 2)  # their median
        assert r["steps"] < one[r["workload"]]["steps"] and r["accepted"] == one[r["workload"]]["accepted"]
