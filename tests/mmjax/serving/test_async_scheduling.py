"""Overlapped scheduling (`serve.async_scheduling`): step N+1 is launched before step N's tokens reach the host
and takes its decode inputs from N's samples on the device. On a mixed stream (arrivals while others run, EOS,
stop tokens, stop strings, max_tokens, aborts, preemption in a small pool, seeded sampling with penalties and
logprobs, a beam search that turns the overlap off for a while) it gives every request exactly the outputs of
the synchronous engine; the extra token computed for a request that stopped is dropped and every page returns."""

import dataclasses

import numpy as np
import pytest
from test_engine import CharTokenizer

from mmjax.config import Config
from mmjax.serving.engine import Engine
from mmjax.serving.request import SamplingParams


class FrequentEosTokenizer(CharTokenizer):
    """EOS is a token this tiny random model draws often, so requests do stop on it."""

    eos_id = 5


@pytest.fixture(scope="module")
def engines(tiny):
    model_cfg = tiny["config"](text_only=True)
    model = tiny["model"](model_cfg, seed=5)
    # 13 usable pages of 4 tokens for 4 sequences of up to 40 tokens: requests get preempted
    serve = tiny["serve"](page_size=4, num_pages=14, max_num_batched_tokens=16, max_num_seqs=4, min_token_bucket=8,
                          max_model_len=40, max_beam_width=2)

    def make(overlap: bool, launch_thread: bool = False) -> Engine:
        cfg = dataclasses.replace(Config(), model=model_cfg, serve=dataclasses.replace(
            serve, async_scheduling=overlap, launch_thread=launch_thread))
        return Engine(cfg, model, FrequentEosTokenizer(), warmup=True)

    return make(False), make(True), make(True, launch_thread=True)


def run_stream(engine, jobs, abort_at):
    """Submit `jobs` (prompt, params) a few per step (the same arrival pattern for every engine), abort request
    i once it has `abort_at[i]` tokens; returns each request's streamed tokens, logprobs and final output."""
    rng = np.random.default_rng(11)
    pending = list(enumerate(jobs))
    got, logprobs, final = {}, {}, {}
    inflight_seen = 0
    while pending or engine.has_unfinished():
        for _ in range(int(rng.integers(0, 3))):
            if pending:
                i, (prompt, params) = pending.pop(0)
                rid = engine.add_request(prompt, sampling_params=params, request_id=f"r{i}")
                got[rid], logprobs[rid] = [], []
        for out in engine.step():
            rid = out.request_id
            got[rid].extend(out.new_token_ids)
            logprobs[rid].extend(out.logprobs)
            assert out.token_ids == got[rid] or out.beams  # the output so far holds no placeholder
            if out.finished:
                final[rid] = out
            elif int(rid[1:]) in abort_at and len(out.token_ids) >= abort_at[int(rid[1:])]:
                assert engine.abort(rid)
        inflight_seen += engine._inflight is not None
    return got, logprobs, final, inflight_seen


def test_overlapped_equals_synchronous_on_a_mixed_stream(engines):
    """...and so does the overlapped engine whose device calls are made on a launcher thread."""
    sync, overlap, threaded = engines
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 64, int(n)).tolist() for n in rng.integers(3, 22, 16)]
    plain = [SamplingParams(max_tokens=int(m), ignore_eos=bool(i % 2)) for i, m in enumerate(rng.integers(3, 16, 16))]
    ref, *_ = run_stream(sync, list(zip(prompts, plain)), {})
    text = {rid: CharTokenizer().decode(t) for rid, t in ref.items()}
    params = list(plain)
    params[1] = dataclasses.replace(plain[1], stop_token_ids=(ref["r1"][2],))  # a stop token mid-way
    params[3] = dataclasses.replace(plain[3], stop=(text["r3"][2:4],)) if len(text["r3"]) >= 4 else plain[3]
    params[5] = dataclasses.replace(plain[5], stop=(text["r5"][1:3],), include_stop_str_in_output=True) \
        if len(text["r5"]) >= 3 else plain[5]
    params[6] = SamplingParams(max_tokens=9, temperature=0.9, top_p=0.8, seed=3, logprobs=2,
                               repetition_penalty=1.3, frequency_penalty=0.4, ignore_eos=True)
    params[8] = SamplingParams(max_tokens=7, temperature=1.1, seed=5, presence_penalty=0.8, ignore_eos=True)
    params[10] = SamplingParams(max_tokens=6, use_beam_search=True, best_of=2)
    params[12] = dataclasses.replace(plain[12], logprobs=3)
    jobs = list(zip(prompts, params))
    abort_at = {4: 2, 9: 3, 13: 1}

    results = []
    for engine in (sync, overlap, threaded):
        compiles, chained = engine.runner.num_compiles, engine.runner.num_chained
        preemptions = engine.scheduler.num_preemptions
        results.append(run_stream(engine, jobs, abort_at))
        assert engine.runner.num_compiles == compiles  # nothing compiled after warm-up
        assert engine.scheduler.num_preemptions > preemptions  # the small pool preempted requests
        kv = engine.kv
        kv.check_consistency()
        assert kv.num_free_pages == kv.num_usable_pages  # every page is back, the dropped steps' too
        assert not engine.scheduler.requests
        results[-1] += (engine.runner.num_chained - chained,)
    (want, want_lp, want_final, sync_inflight, sync_chained), (got, got_lp, got_final, inflight, chained) = results[:2]
    assert sync_inflight == 0 and sync_chained == 0
    assert inflight > 0 and chained > 0  # steps ran ahead of their report, inputs taken on the device
    assert got == want
    threaded_got, threaded_lp, threaded_final, threaded_inflight, _ = results[2]
    assert threaded_inflight > 0 and threaded_got == want
    assert {rid: (o.token_ids, o.text, o.finish_reason) for rid, o in threaded_final.items()} == \
        {rid: (o.token_ids, o.text, o.finish_reason) for rid, o in want_final.items()}
    np.testing.assert_allclose([lp.logprob for r in want_lp for lp in threaded_lp[r]],
                               [lp.logprob for r in want_lp for lp in want_lp[r]], atol=1e-5)
    for rid, w in want_final.items():
        g = got_final[rid]
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason, g.beams) == \
            (w.token_ids, w.text, w.finish_reason, w.stop_reason, w.beams), rid
        assert g.metrics.num_generated_tokens == len(w.token_ids)
        np.testing.assert_allclose([lp.logprob for lp in got_lp[rid]], [lp.logprob for lp in want_lp[rid]],
                                   atol=1e-5)
        assert [lp.top_ids for lp in got_lp[rid]] == [lp.top_ids for lp in want_lp[rid]]
    reasons = {rid: o.finish_reason for rid, o in got_final.items()}
    assert [reasons[f"r{i}"] for i in abort_at] == ["abort"] * len(abort_at)
    assert all(len(got[f"r{i}"]) == n for i, n in abort_at.items())
    assert got_final["r1"].stop_reason == ref["r1"][2] and got_final["r1"].finish_reason == "stop"
    assert "stop" in reasons.values() and "length" in reasons.values()
    eos_stops = [rid for rid, t in got.items() if t[-1] == FrequentEosTokenizer.eos_id and reasons[rid] == "stop"]
    assert any(not int(rid[1:]) % 2 for rid in eos_stops)  # a request that does not ignore EOS stopped on it
    assert len(got_final["r10"].beams) == 1
