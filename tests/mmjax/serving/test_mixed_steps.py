"""Mixed calls (`serve.mixed_decode_steps` with `serve.decode_steps` > 1): a call that prefills (a prompt's chunk,
an admitted request) also runs decode steps for the requests decoding after its ragged step. On a stream with
arrivals between steps (chunked prefill, images, a small pool that preempts) every request gets exactly the tokens
and logprobs of one step per call and of the plain greedy forward: EOS, stop tokens, stop strings and max_tokens
inside a call, seeded sampling with penalties and top-k logprobs; nothing compiles after warm-up and every page
returns."""

import dataclasses

import numpy as np
import pytest
from test_engine import EOS, CharTokenizer

from mmjax.config import Config
from mmjax.serving.engine import Engine
from mmjax.serving.kv_manager import KVCacheManager
from mmjax.serving.request import Request, SamplingParams
from mmjax.serving.scheduler import Scheduler


@pytest.fixture(scope="module")
def setup(tiny):
    model_cfg = tiny["config"]()
    model = tiny["model"](model_cfg, seed=5)
    serve = tiny["serve"](page_size=4, num_pages=22, max_num_batched_tokens=16, max_num_seqs=4, min_token_bucket=8,
                          max_model_len=40, image_cache_size=8, decode_steps=1)

    def make(**kw) -> Engine:
        cfg = dataclasses.replace(Config(), model=model_cfg, serve=dataclasses.replace(serve, **kw))
        return Engine(cfg, model, CharTokenizer(), warmup=True)

    return dict(one=make(), mixed=make(decode_steps=4), ref=tiny["reference"](model, size=40), tiny=tiny,
                make=make)


def _jobs(tiny, seed):
    """Requests of every kind: greedy with EOS, seeded top-p with logprobs, penalties, stop tokens, images."""
    rng = np.random.default_rng(seed)
    img_tok = tiny["image_token"]
    picture = rng.standard_normal((8, 8, 3)).astype(np.float32)
    shared = rng.integers(4, 64, 9).tolist()  # a prefix that the prefix cache serves
    jobs = []
    for i in range(14):
        n = int(rng.integers(3, 24))  # longer than the budget's 16 tokens: chunked prefill
        prompt = rng.integers(4, 64, n).tolist()
        if i % 3 == 2:
            prompt = shared + prompt[:10]
        images = []
        if i % 5 == 1 and n >= 8:
            prompt[2:6] = [img_tok] * 4
            images = [picture]
        kind = i % 4
        max_tokens = int(rng.integers(2, 12))
        params = [SamplingParams(max_tokens=max_tokens, stop_token_ids=[img_tok]),
                  SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.8, seed=i, logprobs=2,
                                 ignore_eos=True, stop_token_ids=[img_tok]),
                  SamplingParams(max_tokens=max_tokens, repetition_penalty=1.4, presence_penalty=0.5,
                                 ignore_eos=True, stop_token_ids=[img_tok]),
                  SamplingParams(max_tokens=max_tokens, temperature=1.1, seed=i, frequency_penalty=0.6,
                                 stop_token_ids=[img_tok, int(prompt[-1])])][kind]
        jobs.append((prompt, images, params))
    # the model's length (40) is reached inside a call
    jobs.append((rng.integers(4, 64, 35).tolist(), [], SamplingParams(max_tokens=12, ignore_eos=True,
                                                                       stop_token_ids=[img_tok])))
    return jobs


def _run(engine, jobs, seed=0):
    """Submit `jobs` a few per step (arrivals between steps, while others prefill and decode); returns each
    request's streamed tokens and logprobs and its final output."""
    rng = np.random.default_rng(seed)
    pending = list(enumerate(jobs))
    got, logprobs, final = {}, {}, {}
    compiles = engine.runner.num_compiles
    while pending or engine.has_unfinished():
        for _ in range(int(rng.integers(0, 3))):
            if pending:
                i, (prompt, images, params) = pending.pop(0)
                rid = engine.add_request(prompt, images, params, request_id=f"r{i}")
                got[rid], logprobs[rid] = [], []
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
            logprobs[out.request_id].extend(out.logprobs)
            assert out.token_ids == got[out.request_id]
            if out.finished:
                final[out.request_id] = out
    assert engine.runner.num_compiles == compiles  # every shape was compiled by warm-up
    assert engine.kv.num_free_pages == engine.kv.num_usable_pages
    engine.kv.check_consistency()
    return got, logprobs, final


def _same(a, b):
    got_a, lps_a, fin_a = a
    got_b, lps_b, fin_b = b
    assert got_a == got_b
    for rid in got_a:
        assert fin_a[rid].finish_reason == fin_b[rid].finish_reason and fin_a[rid].text == fin_b[rid].text
        assert fin_a[rid].stop_reason == fin_b[rid].stop_reason
        np.testing.assert_allclose([lp.logprob for lp in lps_a[rid]], [lp.logprob for lp in lps_b[rid]], atol=1e-5)
        assert [lp.top_ids for lp in lps_a[rid]] == [lp.top_ids for lp in lps_b[rid]]


def test_mixed_calls_equal_single_steps_and_greedy(setup):
    """Arrivals mid-run: the mixed engine's outputs equal one step per call, token for token with logprobs, and
    the greedy requests equal the plain forward; mixed calls ran, with fewer calls than the single steps."""
    jobs = _jobs(setup["tiny"], 0)
    one, mixed = setup["one"], setup["mixed"]
    calls = [one.runner.num_steps, mixed.runner.num_steps]
    want = _run(one, jobs)
    got = _run(mixed, jobs)
    _same(got, want)
    assert mixed.runner.num_mixed > 0 and mixed.stats()["prefix_cache_hits"] > 0
    assert mixed.runner.num_steps - calls[1] < one.runner.num_steps - calls[0]
    assert got[2][f"r{len(jobs) - 1}"].finish_reason == "length" and len(got[0][f"r{len(jobs) - 1}"]) == 5
    ref = setup["ref"]
    for i, (prompt, images, params) in enumerate(jobs):
        if params.temperature == 0 and not params.uses_penalties and len(params.stop_token_ids) == 1:
            eos = None if params.ignore_eos else EOS
            assert got[0][f"r{i}"] == ref.greedy(prompt, params.max_tokens, images, eos=eos)


def test_mixed_calls_stop_inside_a_call(setup):
    """Stops that land inside a mixed call's decode steps: a stop token drawn mid-way, a stop string of the
    text, max_tokens not a multiple of the steps; the tokens after the stop are dropped as one step at a time
    would never make them."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(4, 64, int(n)).tolist() for n in (6, 19, 4, 13, 9)]
    base = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (13, 10, 9, 11, 6)]
    plain = [(p, [], sp) for p, sp in zip(prompts, base)]
    ref = _run(setup["one"], plain)
    toks = [ref[0][f"r{i}"] for i in range(len(prompts))]
    text = ref[2]["r3"].text
    params = [dataclasses.replace(base[0], stop_token_ids=(toks[0][5],)), base[1],
              dataclasses.replace(base[2], stop_token_ids=(toks[2][2],)),
              dataclasses.replace(base[3], stop=(text[5:7],)), dataclasses.replace(base[4], max_tokens=5)]
    jobs = [(p, [], sp) for p, sp in zip(prompts, params)]
    want = _run(setup["one"], jobs, seed=1)
    mixed = setup["mixed"]
    before = mixed.runner.num_mixed
    _same(_run(mixed, jobs, seed=1), want)
    assert mixed.runner.num_mixed > before
    assert len(want[0]["r0"]) <= 6 and want[2]["r3"].finish_reason == "stop"


def test_mixed_calls_off_and_preemption(setup):
    """`serve.mixed_decode_steps=false` keeps prefilling calls at one step (none mixed), and a small pool that
    preempts requests gives the same outputs with mixed calls."""
    jobs = _jobs(setup["tiny"], 2)
    want = _run(setup["one"], jobs, seed=3)
    off = setup["make"](decode_steps=4, mixed_decode_steps=False)
    _same(_run(off, jobs, seed=3), want)
    assert off.runner.num_mixed == 0 and not off.runner.mixed_step_shapes
    small = setup["make"](decode_steps=4, num_pages=12)
    _same(_run(small, jobs, seed=3), want)
    assert small.stats()["num_preemptions"] > 0 and small.runner.num_mixed > 0


def test_scheduler_gives_admitted_and_decoding_requests_the_steps():
    """A step that admits: the decoding request and a prompt completed by its chunk take the call's steps (KV
    reserved for them), a prompt chunked over several steps takes none until its last chunk; off, one step."""
    for mixed in (True, False):
        kv = KVCacheManager(40, 4)
        sched = Scheduler(kv, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64, decode_steps=4,
                          mixed_steps=mixed)
        sched.add_request(Request("a", list(range(4, 10)), SamplingParams(max_tokens=20)))
        out = sched.schedule()
        sched.update_from_output(out, {"a": [7] * out.scheduled[0].num_steps})
        sched.add_request(Request("b", list(range(30, 35)), SamplingParams(max_tokens=2)))
        sched.add_request(Request("c", list(range(40, 60)), SamplingParams(max_tokens=20)))
        out = sched.schedule()
        steps = {e.request_id: (e.num_steps, e.num_tokens, e.samples) for e in out.scheduled}
        assert steps == ({"a": (4, 1, True), "b": (2, 5, True), "c": (1, 10, False)} if mixed else
                         {"a": (1, 1, True), "b": (1, 5, True), "c": (1, 10, False)})
        for e in out.scheduled:  # KV for the tokens fed back: positions up to start + num_tokens + steps - 2
            assert len(kv.block_table(e.request_id)) == kv.pages_for(e.start + e.num_tokens + e.num_steps - 1)
        sched.update_from_output(out, {"a": [7] * steps["a"][0], "b": [8] * steps["b"][0]})
        assert (sched.requests.get("b") is None) == mixed  # max_tokens=2 reached inside the call
        out = sched.schedule()
        c = next(e for e in out.scheduled if e.request_id == "c")
        assert (c.num_tokens, c.samples, c.num_steps) == (10, True, 4 if mixed else 1)
