"""The engine end to end on a tiny MLLM: a stream of requests (chunked prefill, arrivals while others decode,
images, shared prefixes, preemption) gives every request exactly its greedy output run alone through the plain
forward; pages all return; no compile after warm-up; bad requests fail alone; seeded sampling is batch-free."""

import dataclasses
import io

import numpy as np
import pytest
from PIL import Image

from mmjax.config import Config
from mmjax.serving.engine import LLM, Engine
from mmjax.serving.request import Request, RequestError, SamplingParams

EOS = 2


class CharTokenizer:
    """One character per token: ids 4..63 are 'A'..; 3 is the image placeholder, 2 EOS."""

    eos_id = EOS
    image_marker = "<image>"

    def encode(self, text):
        return [4 + (ord(c) - 65) % 60 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + i - 4) for i in ids if i >= 4)


@pytest.fixture(scope="module")
def setup(tiny):
    model_cfg = tiny["config"]()
    model = tiny["model"](model_cfg, seed=5)
    serve = tiny["serve"](page_size=4, num_pages=22, max_num_batched_tokens=32, max_num_seqs=4, min_token_bucket=8,
                          max_model_len=40, image_cache_size=8)
    cfg = dataclasses.replace(Config(), model=model_cfg, serve=serve)
    engine = Engine(cfg, model, CharTokenizer(), warmup=True)
    return dict(engine=engine, ref=tiny["reference"](model, size=40), cfg=cfg, model=model, tiny=tiny)


def _png(image_u8):
    buf = io.BytesIO()
    Image.fromarray(image_u8).save(buf, format="PNG")
    return buf.getvalue()


def test_stream_equals_each_request_alone(setup):
    engine, ref = setup["engine"], setup["ref"]
    compiles = engine.runner.num_compiles
    rng = np.random.default_rng(0)
    img_tok = setup["tiny"]["image_token"]
    shared = rng.integers(4, 64, 13).tolist()
    pictures = [rng.standard_normal((8, 8, 3)).astype(np.float32) for _ in range(3)]
    jobs = []  # (prompt ids, images, max_tokens)
    for i in range(32):
        n = int(rng.integers(3, 26))
        prompt = rng.integers(4, 64, n).tolist()
        if i % 3 == 0:
            prompt = shared + prompt[:8]
        images = []
        if i % 4 == 1 and n >= 8:
            at = int(rng.integers(0, n - 4))
            prompt[at:at + 4] = [img_tok] * 4
            images = [pictures[i % 3]]
        jobs.append((prompt, images, int(rng.integers(2, 9))))
    bad = [(dict(prompt=[]), "empty"), (dict(prompt=list(range(4, 44))), "max_model_len"),
           (dict(prompt=[img_tok] * 4 + [5], images=[b"not a png"]), "cannot be decoded"),
           (dict(prompt=[img_tok] * 4 + [5], images=[pictures[0], pictures[1]]), "placeholders for 1 images"),
           (dict(prompt=[img_tok] * 3 + [5], images=[pictures[0]]), "not a whole number"),
           (dict(prompt=[5, 6], sampling_params={"max_tokens": 0}), "max_tokens"),
           (dict(prompt=[5, 6], sampling_params={"temprature": 0.5}), "unknown sampling parameter")]

    want = {}
    got: dict[str, list[int]] = {}
    finished = {}
    pending = list(enumerate(jobs))
    while pending or engine.has_unfinished():
        for _ in range(int(rng.integers(0, 4))):  # arrivals while others run
            if pending:
                i, (prompt, images, max_tokens) = pending.pop(0)
                params = SamplingParams(max_tokens=max_tokens, stop_token_ids=[img_tok])
                rid = engine.add_request(prompt, images, params, request_id=f"r{i}")
                want[rid] = ref.greedy(prompt, max_tokens, images, eos=EOS)
                got[rid] = []
                if bad and i % 4 == 2:
                    kwargs, message = bad.pop()
                    with pytest.raises(RequestError, match=message):
                        engine.add_request(**kwargs)
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
            assert len(out.logprobs) == len(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = out
    assert not bad
    assert got == want
    for rid, out in finished.items():
        assert out.token_ids == want[rid]
        assert out.finish_reason == ("stop" if want[rid][-1] in (EOS, img_tok) else "length")
        assert out.text == CharTokenizer().decode(want[rid])
        m = out.metrics
        assert m.num_generated_tokens == len(want[rid]) and m.time_to_first_token_s >= m.queue_s >= 0
    kv = engine.kv
    kv.check_consistency()
    assert kv.num_free_pages == kv.num_usable_pages  # every page is back
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert engine.runner.image_cache.misses == 3 and engine.runner.image_cache.hits > 0
    assert engine.runner.num_compiles == compiles  # nothing compiled after warm-up


def test_seeded_sampling_alone_equals_in_batch_and_abort(setup):
    engine = setup["engine"]
    rng = np.random.default_rng(1)
    prompt = rng.integers(4, 64, 9).tolist()
    params = SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True, logprobs=2)
    alone = LLM.__new__(LLM)
    alone.engine = engine
    [solo] = alone.generate([prompt], params)
    others = [rng.integers(4, 64, int(n)).tolist() for n in rng.integers(3, 20, 5)]
    outs = alone.generate([*others[:2], prompt, *others[2:]],
                          [SamplingParams(max_tokens=5, temperature=0.8, seed=int(s)) for s in range(2)] + [params]
                          + [SamplingParams(max_tokens=4, repetition_penalty=1.3)] * 3)
    assert outs[2].token_ids == solo.token_ids and len(solo.token_ids) == 6
    assert all(len(lp.top_ids) == 2 for lp in solo.logprobs)
    np.testing.assert_allclose([lp.logprob for lp in outs[2].logprobs], [lp.logprob for lp in solo.logprobs],
                               atol=1e-5)
    # abort: the final output says so and the pages return
    rid = engine.add_request(prompt, sampling_params=SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    assert engine.abort(rid)
    [out] = engine.step()
    assert out.finished and out.finish_reason == "abort" and not engine.has_unfinished()
    assert engine.kv.num_free_pages == engine.kv.num_usable_pages


def test_a_request_that_breaks_the_step_fails_alone(setup):
    """A value that got past validation and breaks the step's host inputs (top_k beyond int32) fails its
    request alone, naming the cause; the step's other requests are recomputed and still get exactly their
    greedy tokens, every page returns, and the engine serves the next request."""
    engine, ref = setup["engine"], setup["ref"]
    rng = np.random.default_rng(3)
    prompts = [rng.integers(4, 64, n).tolist() for n in (7, 11, 5)]
    bad = SamplingParams(max_tokens=6, temperature=1.0, top_k=5, seed=1)
    object.__setattr__(bad, "top_k", 2**31)  # as if a caller bypassed SamplingParams' own range check
    plain = SamplingParams(max_tokens=6, ignore_eos=True)
    ids = [engine.add_request(prompts[0], None, plain), engine.add_request(prompts[1], None, bad),
           engine.add_request(prompts[2], None, plain)]
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    failed = finished[ids[1]]
    assert failed.finish_reason == "error" and failed.token_ids == []
    assert "sampling parameters" in failed.error and "int32" in failed.error, failed.error
    for rid, prompt in ((ids[0], prompts[0]), (ids[2], prompts[2])):
        assert finished[rid].error is None and finished[rid].token_ids == ref.greedy(prompt, 6, stop=())
    assert engine.kv.num_free_pages == engine.kv.num_usable_pages
    llm = LLM.__new__(LLM)
    llm.engine = engine
    [again] = llm.generate([prompts[1]], plain)
    assert again.token_ids == ref.greedy(prompts[1], 6, stop=())


def test_text_prompt_images_as_bytes_and_stop_string(setup):
    engine, ref = setup["engine"], setup["ref"]
    pixels = np.random.default_rng(2).integers(0, 255, (8, 8, 3)).astype(np.uint8)
    llm = LLM.__new__(LLM)
    llm.engine = engine
    [out] = llm.generate(["AB<image>CDE"], SamplingParams(max_tokens=5, ignore_eos=True, stop_token_ids=[3]),
                         images=[[_png(pixels)]])
    from mmjax.data.image import preprocess
    v = setup["cfg"].model.vision
    prompt = [4, 5] + [3] * 4 + [6, 7, 8]
    want = ref.greedy(prompt, 5, [preprocess(pixels, v.image_size, v.mean, v.std)])
    assert out.prompt_token_ids == prompt and out.token_ids == want
    text = CharTokenizer().decode(want)
    if len(text) >= 2:  # a stop string cuts the text before it and ends the request
        [cut] = llm.generate(["AB<image>CDE"], SamplingParams(max_tokens=5, ignore_eos=True, stop_token_ids=[3],
                                                                 stop=[text[1:3]]),
                             images=[[pixels]])
        assert cut.finish_reason == "stop" and cut.stop_reason == text[1:3] and cut.text == text[:1]


def test_multi_step_decode_equals_single_steps(setup):
    """serve.decode_steps=4 (tokens fed back on device) gives each request the tokens and logprobs of one step
    at a time: greedy with EOS, seeded top-p with top-k logprobs, penalties, stop tokens, max_tokens not a
    multiple of 4; fewer device calls than tokens, no compile after warm-up, every page back."""
    serve = dataclasses.replace(setup["cfg"].serve, decode_steps=4)
    multi = Engine(dataclasses.replace(setup["cfg"], serve=serve), setup["model"], CharTokenizer(), warmup=True)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(4, 64, int(n)).tolist() for n in (5, 9, 3, 12, 7)]
    params = [SamplingParams(max_tokens=11), SamplingParams(max_tokens=9, temperature=0.9, top_p=0.8, seed=3,
                                                             logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=7, repetition_penalty=1.4, presence_penalty=0.5, ignore_eos=True),
              SamplingParams(max_tokens=10, stop_token_ids=[int(prompts[3][0])], ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=1.2, seed=11, frequency_penalty=0.7, ignore_eos=True)]
    outputs = []
    for engine in (setup["engine"], multi):
        llm = LLM.__new__(LLM)
        llm.engine = engine
        compiles, steps = engine.runner.num_compiles, engine.runner.num_steps
        outputs.append(llm.generate(prompts, params))
        assert engine.runner.num_compiles == compiles
        assert engine.kv.num_free_pages == engine.kv.num_usable_pages
    assert multi.runner.num_steps - steps < sum(len(o.token_ids) for o in outputs[1]) - len(prompts)
    for one, many in zip(*outputs):
        assert many.token_ids == one.token_ids and many.finish_reason == one.finish_reason
        np.testing.assert_allclose([lp.logprob for lp in many.logprobs], [lp.logprob for lp in one.logprobs],
                                   atol=1e-5)
        assert [lp.top_ids for lp in many.logprobs] == [lp.top_ids for lp in one.logprobs]


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_top_logprobs_only_for_the_requests_that_ask(setup, decode_steps):
    """A call computes the top-K logprobs only when a request of it asks for them (the sampler's full program;
    a call of plain requests runs the plain one, which returns none). A greedy request without logprobs, alone
    and beside one with logprobs=3 (which arrives while it decodes: with decode_steps=4 a mixed call, then
    multi-step calls), gets the reference's greedy tokens and chosen-token logprobs and no top ones; the other
    gets its 3 most likely tokens and their logprobs as the plain forward's log-softmax orders them. Nothing
    compiles after warm-up."""
    engine = setup["engine"]
    if decode_steps > 1:
        serve = dataclasses.replace(setup["cfg"].serve, decode_steps=decode_steps)
        engine = Engine(dataclasses.replace(setup["cfg"], serve=serve), setup["model"], CharTokenizer(), warmup=True)
    ref, img_tok, runner = setup["ref"], setup["tiny"]["image_token"], engine.runner
    rng = np.random.default_rng(11)
    prompts = [rng.integers(4, 64, int(n)).tolist() for n in (6, 9)]
    params = [SamplingParams(max_tokens=12, stop_token_ids=[img_tok]),
              SamplingParams(max_tokens=5, stop_token_ids=[img_tok], logprobs=3)]
    requests = [Request(f"q{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    assert runner._sampling(requests[:1], 4).top_logprobs == 0  # the plain program: no top-k
    assert runner._sampling(requests, 4).top_logprobs == runner.num_logprobs
    compiles, mixed = runner.num_compiles, runner.num_mixed
    ids = [engine.add_request(prompts[0], sampling_params=params[0])]
    got: dict[str, list] = {ids[0]: []}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].extend(out.logprobs)
        if len(ids) == 1 and len(got[ids[0]]) >= 2:  # the second arrives while the first decodes
            ids.append(engine.add_request(prompts[1], sampling_params=params[1]))
            got[ids[1]] = []
    assert runner.num_compiles == compiles
    assert decode_steps == 1 or runner.num_mixed > mixed
    for prompt, sp, rid in zip(prompts, params, ids):
        want = ref.greedy(prompt, sp.max_tokens, eos=EOS)
        assert [lp.token for lp in got[rid]] == want
        ref_lps = [_log_softmax(ref.logits(prompt + want[:j])[-1]) for j in range(len(want))]
        np.testing.assert_allclose([lp.logprob for lp in got[rid]], [r[t] for r, t in zip(ref_lps, want)], atol=1e-4)
        top = sp.logprobs or 0
        assert [lp.top_ids for lp in got[rid]] == [tuple(np.argsort(-r)[:top].tolist()) for r in ref_lps]
        np.testing.assert_allclose([lp.top_logprobs for lp in got[rid]], [np.sort(r)[::-1][:top] for r in ref_lps],
                                   atol=1e-4)
    assert engine.kv.num_free_pages == engine.kv.num_usable_pages


def test_beam_search_of_one_beam_is_greedy(setup):
    """A beam search of width 1 gets its candidates (top logprobs) like a wider one and gives the greedy tokens."""
    prompt = [5, 6, 7, 8]
    want = setup["ref"].greedy(prompt, 6, eos=EOS)
    assert len(want) == 6 and EOS not in want and setup["tiny"]["image_token"] not in want  # no early stop
    llm = LLM.__new__(LLM)
    llm.engine = setup["engine"]
    [out] = llm.generate([prompt], SamplingParams(max_tokens=6, use_beam_search=True))
    assert out.token_ids == want and [b[0] for b in out.beams] == [want]


def test_overlapped_decode_equals_single_steps(setup):
    """serve.overlap_decode: each multi-step call is launched before the previous one's tokens are read. Requests
    that stop inside a call (a stop token, a stop string, max_tokens) or are aborted while the next call is
    already queued give exactly the tokens of one step at a time; the chained work is dropped, pages all return
    and nothing compiles after warm-up. The calls are made on the launcher thread (`serve.launch_thread`; the
    multi-step test above makes them on the engine's own)."""
    serve = dataclasses.replace(setup["cfg"].serve, decode_steps=4, launch_thread=True)
    multi = Engine(dataclasses.replace(setup["cfg"], serve=serve), setup["model"], CharTokenizer(), warmup=True)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(4, 64, int(n)).tolist() for n in (6, 10, 4, 8)]
    base = [SamplingParams(max_tokens=13, ignore_eos=True),
            SamplingParams(max_tokens=14, temperature=0.8, top_p=0.9, seed=5, logprobs=2, ignore_eos=True),
            SamplingParams(max_tokens=9, ignore_eos=True), SamplingParams(max_tokens=15, ignore_eos=True)]
    one = LLM.__new__(LLM)
    one.engine = setup["engine"]
    ref = one.generate(prompts, base)
    # stop inside a call: request 2 on a token it draws mid-way, request 3 on a string of its text
    params = [base[0], base[1], dataclasses.replace(base[2], stop_token_ids=(ref[2].token_ids[5],)),
              dataclasses.replace(base[3], stop=(ref[3].text[6:8],))]
    want = one.generate(prompts, params)
    compiles = multi.runner.num_compiles
    ids = [multi.add_request(p, sampling_params=sp) for p, sp in zip(prompts, params)]
    got: dict[str, list[int]] = {rid: [] for rid in ids}
    logprobs: dict[str, list] = {rid: [] for rid in ids}
    finished = {}
    aborted = None
    while multi.has_unfinished():
        for out in multi.step():
            got[out.request_id].extend(out.new_token_ids)
            logprobs[out.request_id].extend(out.logprobs)
            if out.finished:
                finished[out.request_id] = out
        if aborted is None and multi._ahead is not None and len(got[ids[0]]) >= 4:
            aborted = ids[0]
            assert multi.abort(aborted)  # while a call that holds it is queued
    assert multi.runner.num_chained > 0
    for rid, w in zip(ids[1:], want[1:]):
        assert got[rid] == w.token_ids and finished[rid].finish_reason == w.finish_reason
        assert finished[rid].text == w.text
    lps = logprobs[ids[1]]  # seeded sampling with top-2 logprobs
    np.testing.assert_allclose([lp.logprob for lp in lps], [lp.logprob for lp in want[1].logprobs], atol=1e-5)
    assert [lp.top_ids for lp in lps] == [lp.top_ids for lp in want[1].logprobs]
    assert finished[aborted].finish_reason == "abort" and got[aborted] == want[0].token_ids[:len(got[aborted])]
    assert multi.runner.num_compiles == compiles
    assert multi.kv.num_free_pages == multi.kv.num_usable_pages
    multi.kv.check_consistency()


@pytest.mark.parametrize("override, message", [
    ("serve.page_size=12", "power of two"), ("serve.num_pages=1", "null page"),
    ("serve.max_num_seqs=512", "max_num_batched_tokens"), ("serve.max_model_len=100000", "model.max_seq_len"),
    ("serve.kv_cache_dtype=int4", "not one of"),
    ("serve.quantization=int3", "not one of"), ("serve.max_logprobs=21", "max_logprobs")])
def test_serve_config_is_validated(override, message):
    from mmjax.config import load_config
    from mmjax.errors import ConfigError
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize("decode_steps", [4, 1])
def test_multi_step_decode_through_the_gpu_kernels_equals_xla(tiny, monkeypatch, decode_steps):
    """The multi-step decode, and single decode steps (overlapped), with a GPU's kernel choices (assumed; Pallas
    in interpret mode: attention writing its own k, v in slot order, norms, SwiGLU) generate the tokens of the
    XLA paths."""
    import importlib

    from mmjax.kernels import _dispatch

    kernel = importlib.import_module("mmjax.kernels.ragged_paged_attention.pallas")
    calls, attend = [], kernel.ragged_paged_attention_pallas

    def spy(*args, **kwargs):
        calls.append((kwargs.get("new_kv") is not None, kwargs.get("slot_tokens")))
        return attend(*args, **kwargs)
    monkeypatch.setattr(kernel, "ragged_paged_attention_pallas", spy)

    model_cfg = tiny["config"](text_only=True)
    model_cfg = dataclasses.replace(model_cfg, text=dataclasses.replace(model_cfg.text, dim=64))  # head_dim 16
    model = tiny["model"](model_cfg, seed=5)
    serve = tiny["serve"](page_size=4, num_pages=22, max_num_batched_tokens=16, max_num_seqs=4, min_token_bucket=8,
                          max_model_len=40, decode_steps=decode_steps)
    cfg = dataclasses.replace(Config(), model=model_cfg, serve=serve)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(4, 64, int(n)).tolist() for n in (5, 9, 3)]
    params = [SamplingParams(max_tokens=9, ignore_eos=True)] * 3

    def generate():
        llm = LLM.__new__(LLM)
        llm.engine = Engine(cfg, model, CharTokenizer(), warmup=False)
        return [o.token_ids for o in llm.generate(prompts, params)], llm.engine.runner.num_mixed

    want, _ = generate()
    with _dispatch.assume_platform("gpu", (9, 0)):
        got, mixed = generate()
    assert got == want and all(len(ids) == 9 for ids in got)
    assert (mixed > 0) == (decode_steps > 1)  # the prefilling calls decoded too (mixed calls)
    assert (True, True) in calls  # the decode steps' attention wrote k, v itself, in slot order
