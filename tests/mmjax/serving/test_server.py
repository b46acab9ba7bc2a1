"""The OpenAI-compatible server, run for real on 127.0.0.1 and driven with the official `openai` client: chat with
an image, streaming with usage, a chunk per token of multi-step outputs (the servers run serve.decode_steps=4), stop
strings, n > 1, seeds, logprobs, greedy == the engine offline; every error
status followed by a good request; overload 429s with Retry-After; interactive work preempting batch work; a
disconnect returning its pages; SIGTERM draining a subprocess server to exit 0; /metrics parsing."""

import base64
import dataclasses
import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from flax import nnx
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from mmjax.checkpoint.orbax_state import FORMAT_VERSION, Checkpointer
from mmjax.config import Config, DataConfig, to_dict
from mmjax.data.tokenizer import SPECIAL_TOKENS
from mmjax.serving.core.client import EngineCoreClient
from mmjax.serving.engine import Engine
from mmjax.serving.http.admission import Admission
from mmjax.serving.http.chat import parse_messages
from mmjax.serving.http.server import make_server, serve_service
from mmjax.serving.load import load_for_serving
from mmjax.serving.request import SamplingParams
from mmjax.serving.served_model import ModelSource

SERVE = ["serve.page_size=4", "serve.num_pages=48", "serve.max_num_batched_tokens=32", "serve.max_num_seqs=4",
         "serve.min_token_bucket=32", "serve.min_slot_bucket=4", "serve.max_logprobs=3",
         "serve.interactive_ttft_s=60"]  # a loaded CI machine must not turn into TTFT refusals (test_admission.py)
MODEL = "tiny"
ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base: str, died: Callable[[], str], timeout: float = 120) -> None:
    """Poll GET /ready until 200; `died()` returns the server's last output once it has exited ("" while up)."""
    deadline = time.monotonic() + timeout
    while True:
        output = died()
        assert not output, output
        assert time.monotonic() < deadline, "server not ready"
        try:
            if httpx.get(base + "/ready").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)


def write_run(root: Path, tiny) -> Path:
    """A run folder (checkpoints/3) of a tiny random MLLM whose config names a word-level tokenizer."""
    words = {t: i for i, t in enumerate(SPECIAL_TOKENS.values())} | {f"w{i}": i for i in range(6, 64)}
    tok = HFTokenizer(models.WordLevel(words, unk_token="w6"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(SPECIAL_TOKENS.values()))  # the rendered template is tokenized as one string
    (root / "tok").mkdir(parents=True)
    tok.save(str(root / "tok" / "tokenizer.json"))
    (root / "tok" / "tokenizer_config.json").write_text(json.dumps({f"{r}_token": t for r, t in
                                                                    SPECIAL_TOKENS.items()}))
    model_cfg = tiny["config"]()
    model = tiny["model"](model_cfg, seed=11)
    cfg = dataclasses.replace(Config(), model=model_cfg, data=DataConfig(tokenizer=str(root / "tok/tokenizer.json")))
    writer = Checkpointer(root / "run" / "checkpoints", keep=0, async_save=False)
    meta = {"format_version": FORMAT_VERSION, "kind": "params", "step": 3, "config": to_dict(cfg)}
    writer.save_params(3, nnx.to_pure_dict(nnx.state(model, nnx.Param)), meta)
    writer.close()
    return root / "run"


@pytest.fixture(scope="module")
def run_dir(tiny, tmp_path_factory):
    return write_run(tmp_path_factory.mktemp("server"), tiny)


@pytest.fixture(scope="module")
def cli_server(run_dir):
    """`python -m mmjax.serve` in a subprocess, started first so its start-up overlaps the other tests."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-m", "mmjax.serve", "--checkpoint", str(run_dir), *SERVE,
                             "serve.max_num_seqs=1", "serve.min_slot_bucket=1", f"serve.port={port}",
                             "serve.model_name=tiny"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=run_dir.parent)
    yield proc, f"http://127.0.0.1:{port}"
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module", params=["thread", "process"])
def server(request, run_dir, cli_server):
    """The server on 127.0.0.1, its engine on a thread of this process or in an engine-core process of its own
    (serve.engine_process); `engine` is an in-process engine of the same checkpoint either way."""
    mode = request.param
    root, run = run_dir.parent, run_dir
    port = free_port()
    media = root / mode / "media"  # each server's own allowed folder (and files beside it)
    media.mkdir(parents=True)
    # several decode steps per device call, as on an accelerator (the CPU default is 1): outputs of several tokens
    overrides = [*SERVE, "serve.decode_steps=4", f"serve.port={port}",
                 f"serve.request_log={media.parent / 'requests.jsonl'}", f"serve.allowed_local_media_path={media}"]
    cfg, model, tok = load_for_serving(run / "checkpoints", overrides=overrides)
    engine = Engine(cfg, model, tok)
    # the engine's offline greedy answer to compare HTTP with, computed before the server owns the engine
    prompt = [1, 4, 7, 8, 9, 10, 5]  # <|bos|> <|user|> w7 w8 w9 w10 <|assistant|>
    engine.add_request(prompt, None, SamplingParams(max_tokens=12), request_id="offline")
    offline = ""
    while engine.has_unfinished():
        offline += "".join(o.new_text for o in engine.step())
    # and its offline beam search (3 beams, the 2 best), for the HTTP one to equal
    engine.add_request(prompt, None, SamplingParams(max_tokens=6, use_beam_search=True, n=2, best_of=3),
                       request_id="offline-beam")
    beams = []
    while engine.has_unfinished():
        beams += [o.beams for o in engine.step() if o.finished]
    offline_beams = [tok.decode(tokens) for tokens, _ in beams[0]]
    if mode == "process":  # the core loads the checkpoint itself, from the same arguments
        client = EngineCoreClient(ModelSource(cfg, checkpoint=str(run / "checkpoints")), cfg.serve)
        srv, service = serve_service(client, MODEL, log_level="warning")
    else:
        srv, service = make_server(engine, tok, cfg.serve, MODEL, log_level="warning")
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, lambda: "")
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    yield dict(mode=mode, media=media, base=base, client=client, service=service, state=srv.app_state,
               offline=offline, run=run, offline_beams=offline_beams,
               log=media.parent / "requests.jsonl", cfg=cfg, engine=engine)
    srv.should_exit = True
    thread.join(10)
    service.stop()


def png_data_url(seed=0) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (12, 12, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def metrics(base) -> dict:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(base + "/metrics").text):
        for s in fam.samples:
            key = s.name + ("" if not s.labels else "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                            + "}")
            out[key] = s.value
    return out


class _Resume:
    def __init__(self, pid: int) -> None:
        self.pid = pid

    def set(self) -> None:
        os.kill(self.pid, signal.SIGCONT)


def hold(service):
    """Stop the engine thread between two steps (an engine-core process: freeze it with SIGSTOP); returns what
    lets it go on (`.set()`)."""
    if isinstance(service, EngineCoreClient):
        os.kill(service.pid, signal.SIGSTOP)
        return _Resume(service.pid)
    frozen, thaw = threading.Event(), threading.Event()
    service.post(lambda: (frozen.set(), thaw.wait(30)))
    assert frozen.wait(30)
    return thaw


def hold_on_first_output(service):
    """Stop the engine as soon as a step produced a token, so it cannot run far ahead of the test (polling /metrics
    on a loaded machine can miss a whole request): an engine-core process is frozen (SIGSTOP) from the client's
    receiver thread, an engine thread blocks after that step (before its outputs are handed over). `.frozen` is
    set once it is held, `.set()` lets it go on."""
    if not isinstance(service, EngineCoreClient):
        engine, thaw = service.engine, threading.Event()
        thaw.frozen = threading.Event()
        step = engine.step  # the bound method; the instance attribute set below is the wrapper until the hold

        def step_then_hold():
            outputs = step()
            if any(o.new_token_ids for o in outputs):
                del engine.step
                thaw.frozen.set()
                thaw.wait(30)
            return outputs

        engine.step = step_then_hold
        return thaw
    client = service
    resume = _Resume(client.pid)
    resume.frozen = threading.Event()
    output = client._output

    def freeze_then_output(o, now, ready):
        if not resume.frozen.is_set() and o.new_token_ids:
            os.kill(client.pid, signal.SIGSTOP)
            resume.frozen.set()
            client._output = output
        output(o, now, ready)

    client._output = freeze_then_output
    return resume


def user(text):
    return [{"role": "user", "content": text}]


def test_greedy_chat_equals_offline_and_completions(server):
    c = server["client"]
    r = c.chat.completions.create(model=MODEL, messages=user("w7 w8 w9 w10"), max_tokens=12, temperature=0)
    want_text = server["offline"]
    assert r.choices[0].message.content == want_text and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == 7 and r.usage.completion_tokens == 12
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    # the same prompt through /v1/completions with token ids, and the prefix cache reported in usage
    r2 = c.completions.create(model=MODEL, prompt=[1, 4, 7, 8, 9, 10, 5], max_tokens=12, temperature=0)
    assert r2.choices[0].text == want_text and r2.usage.prompt_tokens_details.cached_tokens == 4
    assert [m.id for m in c.models.list().data] == [MODEL]


def test_chat_with_image_streaming_usage(server):
    c = server["client"]
    messages = [{"role": "system", "content": "w20"},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_url()}},
                                             {"type": "text", "text": "w9 w11"}]}]
    whole = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.usage.prompt_tokens == 1 + 2 + 1 + 4 + 2 + 1  # bos, user w20 (the system turn), user, 4 image tokens,
    # w9 w11, assistant
    # a local file:// image under serve.allowed_local_media_path reads the same bytes
    path = server["media"] / "im.png"
    path.write_bytes(base64.b64decode(png_data_url().split(",", 1)[1]))
    messages[1]["content"][0]["image_url"]["url"] = f"file://{path}"
    again = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert again.choices[0].message.content == whole.choices[0].message.content


def test_stop_n_seed_logprobs(server):
    c = server["client"]
    base = c.completions.create(model=MODEL, prompt="w7 w8 w9", max_tokens=10, temperature=0, extra_body={
        "ignore_eos": True})
    words = base.choices[0].text.split()
    stop = words[2]
    cut = c.completions.create(model=MODEL, prompt="w7 w8 w9", max_tokens=10, temperature=0, stop=[stop],
                               extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    assert base.choices[0].text.startswith(cut.choices[0].text.rstrip())
    kw = dict(model=MODEL, messages=user("w12 w13"), max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    a = c.chat.completions.create(n=3, seed=7, **kw)
    b = c.chat.completions.create(n=3, seed=7, **kw)
    assert [x.index for x in a.choices] == [0, 1, 2]
    assert [x.message.content for x in a.choices] == [x.message.content for x in b.choices]
    assert len({x.message.content for x in a.choices}) > 1  # each choice draws its own tokens
    assert a.usage.completion_tokens == 24
    lp = c.chat.completions.create(model=MODEL, messages=user("w12"), max_tokens=4, temperature=0, logprobs=True,
                                   top_logprobs=2)
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)  # greedy = most likely
    lc = c.completions.create(model=MODEL, prompt="w12", max_tokens=3, temperature=0, logprobs=2)
    assert len(lc.choices[0].logprobs.token_logprobs) == 3 and len(lc.choices[0].logprobs.top_logprobs[0]) == 2


def stream_choice(chunks: list, chat: bool) -> tuple[list[str], list, str | None]:
    """A streamed single choice: its non-empty content deltas, its logprob entries in order, its finish_reason."""
    texts, entries, finish = [], [], None
    for ch in chunks:
        if not ch.choices:
            continue
        choice = ch.choices[0]
        assert finish is None  # nothing after the chunk with the finish_reason
        text = choice.delta.content if chat else choice.text
        texts += [text] if text else []
        lp = choice.logprobs
        if lp is not None and chat:
            entries += [e.model_dump() for e in lp.content or []]
        elif lp is not None:
            entries += list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset, strict=True))
        finish = choice.finish_reason
    return texts, entries, finish


def whole_entries(choice, chat: bool) -> list:
    lp = choice.logprobs
    if chat:
        return [e.model_dump() for e in lp.content]
    return list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset, strict=True))


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_multi_step_outputs_stream_a_chunk_per_token(server, chat):
    """With serve.decode_steps=4 one engine output carries several tokens; a stream still sends each token's text
    in a chunk of its own, its logprob entry with it, and their concatenation is the plain response's text and
    entries."""
    c, base = server["client"], server["base"]
    create = c.chat.completions.create if chat else c.completions.create
    kw = dict(model=MODEL, max_tokens=12, temperature=0, extra_body={"ignore_eos": True},
              **({"messages": user("w7 w8 w9")} if chat else {"prompt": "w7 w8 w9"}))
    lp = dict(logprobs=True, top_logprobs=2) if chat else dict(logprobs=2)
    whole = create(**kw, **lp).choices[0]
    text = whole.message.content if chat else whole.text
    tokens = [e[0] if not chat else e["token"] for e in whole_entries(whole, chat)]
    assert len(tokens) == 12 and "".join(tokens) == text.replace(" ", "")
    steps = metrics(base)["mmjax:engine_steps_total"]
    texts, entries, finish = stream_choice(list(create(**kw, stream=True)), chat)
    assert metrics(base)["mmjax:engine_steps_total"] - steps < 12  # device calls of several tokens each
    # a word-level tokenizer: every token but a special one (no text) releases its word, with a space after the first
    assert [t.strip() for t in texts] == [t for t in tokens if t] and "".join(texts) == text
    assert finish == whole.finish_reason == "length" and entries == []
    # with logprobs: one chunk per token (a token without text too), each carrying that token's entry
    chunks = [ch for ch in create(**kw, **lp, stream=True) if ch.choices and ch.choices[0].logprobs is not None]
    texts, entries, finish = stream_choice(chunks, chat)
    assert len(chunks) == 12 and entries == whole_entries(whole, chat) and "".join(texts) == text
    assert finish == "length"


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_stop_strings_end_a_multi_step_stream_as_the_plain_response(server, chat):
    """A stop string completed inside an output of several tokens ends the streamed text (and its logprob entries)
    exactly where the plain response's end; text held back as a possible stop string is released whole."""
    c = server["client"]
    create = c.chat.completions.create if chat else c.completions.create
    kw = dict(model=MODEL, max_tokens=12, temperature=0, extra_body={"ignore_eos": True},
              **({"messages": user("w7 w8 w10")} if chat else {"prompt": "w7 w8 w10"}),
              **(dict(logprobs=True, top_logprobs=1) if chat else dict(logprobs=1)))
    get = (lambda ch: ch.message.content) if chat else (lambda ch: ch.text)
    words = get(create(**kw).choices[0]).split()
    assert len(words) == 12
    # word n-grams (a tiny random model's greedy text repeats): the first completes at the 6th token, the second
    # at the 5th while the first's "w.. nowhere" is held back from the 4th; the last never completes
    for stop, reason in (([" ".join(words[1:6])], "stop"),
                         ([f"{words[3]} nowhere", " ".join(words[2:5])], "stop"), ([f"{words[4]} nowhere"], "length")):
        whole = create(**kw, stop=stop).choices[0]
        texts, entries, finish = stream_choice(list(create(**kw, stop=stop, stream=True)), chat)
        assert whole.finish_reason == finish == reason, stop
        assert "".join(texts) == get(whole) and entries == whole_entries(whole, chat), stop
        n = len(get(whole).split())
        assert not any(s in get(whole) for s in stop) and (n <= 2 if reason == "stop" else n == 12), stop


def test_beam_search_equals_the_engines(server):
    """vLLM's extra body: n best of best_of beams as n choices, whole or streamed; what beams cannot do refused."""
    base, c = server["base"], server["client"]
    kw = dict(model=MODEL, messages=user("w7 w8 w9 w10"), max_tokens=6, n=2,
              extra_body={"use_beam_search": True, "best_of": 3})
    r = c.chat.completions.create(**kw)
    assert [x.message.content for x in r.choices] == server["offline_beams"] and [x.index for x in r.choices] == [0, 1]
    assert all(x.finish_reason in ("stop", "length") for x in r.choices)
    streamed = ["", ""]
    for chunk in c.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == server["offline_beams"]
    bad = [(dict(logprobs=True), "logprobs"), (dict(stop=["w9"]), "stop"), (dict(temperature=0.7), "temperature"),
           (dict(use_beam_search=False), "best_of")]
    for extra, words in bad:
        body = {**{k: v for k, v in kw.items() if k != "extra_body"}, **kw["extra_body"], **extra}
        resp = httpx.post(base + "/v1/chat/completions", json=body)
        assert resp.status_code == 422 and words in resp.json()["error"]["message"], resp.text


def test_errors_then_a_good_request(server):
    base, c = server["base"], server["client"]
    good = dict(model=MODEL, messages=user("w7"), max_tokens=2)
    img = lambda url: dict(good, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "w7"}]}])
    cases = [
        (b"{not json", 400, "invalid JSON"),
        (dict(good, model="gpt-4"), 404, "does not exist"),
        (img("data:image/png;base64,@@@notbase64"), 400, "base64"),
        (img("data:image/png;base64," + base64.b64encode(b"not an image").decode()), 400, "decode"),
        (dict(good, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": png_data_url()}}] * 5}]), 400, "too many images"),
        (dict(good, messages=user(" ".join(["w9"] * 70))), 400, "maximum context length"),
        (dict(good, max_tokens=60, messages=user("w9 w9 w9 w9 w9")), 400, "maximum context length"),
        (dict(good, temperature=-1), 422, "temperature"),
        (dict(good, top_p=0), 422, "top_p"),
        (dict(good, logprobs=True, top_logprobs=5), 422, "serve.max_logprobs"),
        (dict(good, n=0), 422, "n"),
    ]
    for body, status, words in cases:
        kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {
            "json": body}
        r = httpx.post(base + "/v1/chat/completions", **kw)
        assert r.status_code == status, (body if isinstance(body, bytes) else str(body)[:200], r.text)
        err = r.json()["error"]
        assert words in err["message"] and err["type"], err
    assert c.chat.completions.create(**good).choices[0].finish_reason in ("stop", "length")


def thread_only(server, why):
    if server["mode"] != "thread":
        pytest.skip(f"reaches into the engine thread: {why}")


def test_overload_429_with_retry_after_while_accepted_complete(server):
    thread_only(server, "swaps the service's admission (in an engine-core process it lives in the core)")
    service, cfg = server["service"], server["cfg"]
    saved = service.admission
    service.admission = Admission(dataclasses.replace(cfg.serve, token_budget=60.0))  # one 60-token request a second
    try:
        body = dict(model=MODEL, messages=user("w7 w8"), max_tokens=40, extra_body={"ignore_eos": True})

        def one(_):
            try:
                return server["client"].chat.completions.create(**body)
            except openai.RateLimitError as e:
                return e
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(8)))
    finally:
        service.admission = saved
    ok = [r for r in results if not isinstance(r, Exception)]
    refused = [r for r in results if isinstance(r, Exception)]
    assert ok and refused
    assert all(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 40 for r in ok)
    assert all(int(e.response.headers["retry-after"]) >= 1 and e.body["code"] == "token_budget" for e in refused)
    m = metrics(server["base"])
    assert m["mmjax:request_rejected_total{reason=token_budget,sla_class=interactive}"] == len(refused)


def test_interactive_preempts_batch(server):
    thread_only(server, "counts queued commands and reads the scheduler's running list")
    c, log, service = server["client"], server["log"], server["service"]
    batch = dict(model=MODEL, max_tokens=50, temperature=0, extra_body={"ignore_eos": True, "sla_class": "batch"})
    before = metrics(server["base"])["mmjax:num_preemptions_total"]
    running = service.engine.scheduler.running
    num_batch = lambda: sum(r.priority >= 1_000_000 for r in list(running))  # noqa: E731

    def queued(n):
        deadline = time.monotonic() + 30
        while service._commands.qsize() < n:
            assert time.monotonic() < deadline
            time.sleep(0.001)
    with ThreadPoolExecutor(5) as pool:
        thaw = hold(service)  # the four batch requests are added together, so all four run from the next step on
        jobs = [pool.submit(c.chat.completions.create, messages=user(f"w{20 + i} w30"), **batch) for i in range(4)]
        queued(4)
        thaw.set()
        deadline = time.monotonic() + 30
        while num_batch() < 4:
            assert time.monotonic() < deadline and not any(j.done() for j in jobs)
        thaw = hold(service)  # every sequence slot holds a batch request: an interactive one arrives now
        assert num_batch() == 4
        fast = pool.submit(c.chat.completions.create, model=MODEL, messages=user("w40"), max_tokens=3,
                           temperature=0, extra_body={"ignore_eos": True})
        queued(1)
        thaw.set()
        fast = fast.result()
        slow = [j.result() for j in jobs]
    assert all(r.usage.completion_tokens == 50 for r in slow)
    assert metrics(server["base"])["mmjax:num_preemptions_total"] > before
    rec = [json.loads(x) for x in log.read_text().splitlines()]
    at = [k for k, r in enumerate(rec) if r["request_id"].startswith(fast.id)][0]
    mine, batch_recs = rec[at], [r for r in rec if r["sla_class"] == "batch"]
    assert len(batch_recs) == 4 and all(r["sla_class"] == "batch" for r in rec[at + 1:])  # finished first
    assert sum(r["preemptions"] for r in batch_recs) >= 1
    assert mine["ttft_s"] < min(r["e2e_s"] for r in batch_recs)
    assert {"queue_s", "prefill_s", "decode_s", "postprocess_s", "ttft_s", "e2e_s"} <= set(mine)


def test_disconnect_mid_stream_frees_pages(server):
    base = server["base"]
    aborted = "mmjax:request_success_total{finished_reason=abort,sla_class=interactive}"
    before = metrics(base).get(aborted, 0)
    # the prompt once first, so its full page is in the prefix cache whatever this server ran before (an engine-core
    # process starts with an empty cache): the choices below hit it
    server["client"].chat.completions.create(model=MODEL, messages=user("w7 w8"), max_tokens=1)
    # 16 choices of 55 tokens on 4 sequence slots: far from done when the client goes away
    body = {"model": MODEL, "messages": user("w7 w8"), "max_tokens": 55, "n": 16, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body) as r:
        # read up to the first token: the server has then taken in an output whose metrics the abort records
        # (the role chunks come before any; leaving after them alone would record no time to first token)
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        assert any('"content":"' in line and '"content":""' not in line for line in lines)
        thaw = hold(server["service"])  # the client goes away while its requests hold pages
        assert metrics(base)["mmjax:kv_cache_usage_perc"] > 0
    thaw.set()
    deadline = time.monotonic() + 10
    running = "mmjax:num_requests_running{sla_class=interactive}"
    waiting = "mmjax:num_requests_waiting{sla_class=interactive}"
    while (m := metrics(base))["mmjax:kv_cache_usage_perc"] > 0 or m[running] > 0 or m[waiting] > 0:
        assert time.monotonic() < deadline, m
        time.sleep(0.02)
    assert m[aborted] - before >= 8  # most of the 16 were aborted, not finished
    assert m["mmjax:num_compiles_after_warmup"] == 0
    assert m["mmjax:time_to_first_token_seconds_count{sla_class=interactive}"] > 0
    # an abandoned choice that had produced tokens logs its timings and tokens, not only its status
    abandoned = [r for r in map(json.loads, server["log"].read_text().splitlines()) if r["status"] == 499]
    assert any(r.get("ttft_s") is not None and r["generated_tokens"] > 0 for r in abandoned)
    assert m["mmjax:prefix_cache_queries_total"] >= m["mmjax:prefix_cache_hits_total"] > 0
    assert httpx.get(base + "/health").status_code == 200


def test_sigterm_drains_and_exits_0(cli_server):
    proc, base = cli_server
    wait_ready(base, lambda: proc.stdout.read().decode()[-3000:] if proc.poll() is not None else "")
    # two streams of 16 choices x 58 tokens, one sequence at a time: SIGTERM arrives with most of them queued
    body = {"model": MODEL, "messages": user("w7"), "max_tokens": 58, "n": 16, "stream": True, "ignore_eos": True}

    def stream(_):
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as r:
            return [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(stream, k) for k in range(2)]
        deadline = time.monotonic() + 60
        while metrics(base)["mmjax:num_requests_waiting{sla_class=interactive}"] < 16 + 8:  # both admitted
            assert time.monotonic() < deadline and not any(j.done() for j in jobs)
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)
        while httpx.get(base + "/ready").status_code == 200:  # until the signal handler ran
            time.sleep(0.001)
        refused = httpx.post(base + "/v1/chat/completions", json={**body, "stream": False, "n": 1})
        results = [j.result() for j in jobs]
    assert refused.status_code == 503 and "draining" in refused.json()["error"]["message"]
    for chunks in results:
        assert sorted(c["index"] for x in chunks for c in x["choices"] if c["finish_reason"] == "length") == list(
            range(16))
    assert proc.wait(60) == 0, proc.stdout.read().decode()[-3000:]


def test_bench_serving_server_mode(server, tmp_path):
    from mmjax.tools import bench_serving

    out = tmp_path / "sweep.json"
    assert bench_serving.main(["--server", server["base"], "--rates", "20", "40", "--num-requests", "6",
                               "--prompt-mu", "2.0", "--output-mu", "1.5", "--image-every", "3", "--slo-ttft", "0.5",
                               "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert [r["rate"] for r in record["rates"]] == [20.0, 40.0] and out.with_suffix(".png").stat().st_size > 0
    for row in record["rates"]:
        assert row["completed"] + row["rejected_429"] == 6 and row["failed"] == 0
        assert row["ttft_s"]["p50"] <= row["ttft_s"]["p90"] <= row["ttft_s"]["p99"] <= row["e2e_s"]["p99"]
        assert row["output_tok_s"] > 0 and 0 <= row["goodput_req_s"] <= row["throughput_req_s"]
        assert row["itl_s"]["p90"] <= row["e2e_s"]["p99"] and row["chunk_gap_s"]["p50"] is not None
        # which process was busy: the API one always, the engine core's when it has its own process
        busy = row["processes"]
        assert set(busy) == ({"api", "engine"} if server["mode"] == "process" else {"api"}), busy
        for b in busy.values():
            assert b["cpu_cores"] > 0 and b["cpu_us_per_output_token"] > 0 and b["gc_full_collections"] >= 0


def test_cli_errors(tmp_path, capsys):
    from mmjax import serve

    assert serve.main(["--checkpoint", str(tmp_path / "none")]) == 1
    assert "no checkpoint at" in capsys.readouterr().err
    assert serve.main(["serve.token_budget=-1"]) == 2
    assert "serve.token_budget must be >= 0" in capsys.readouterr().err


# -- a server no client can break (bounded inputs, local media, keys, one error format, failures) ----------------


def host_port(base: str) -> tuple[str, int]:
    host, port = base.removeprefix("http://").split(":")
    return host, int(port)


def raw_request(base: str, head: bytes, body: bytes = b"") -> socket.socket:
    """A connection that has sent `head` (request line and headers, without the blank line) and `body`."""
    sock = socket.create_connection(host_port(base), timeout=30)
    sock.sendall(head + b"\r\n\r\n" + body)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict]:
    """Status and JSON body of the response on `sock` (Content-Length framed)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    fields = dict(line.lower().split(b":", 1) for line in head.split(b"\r\n")[1:])
    length = int(fields[b"content-length"])
    while len(rest) < length:
        rest += sock.recv(65536)
    return int(head.split(b" ")[1]), json.loads(rest[:length])


def assert_openai_error(r: httpx.Response, status: int, words: str = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and words in err["message"], err
    assert " object at 0x" not in err["message"]
    return err


def test_out_of_range_values_422_naming_the_field_then_a_good_request(server):
    base, c = server["base"], server["client"]
    good = dict(model=MODEL, messages=user("w7"), max_tokens=2)
    vocab = server["engine"].model_cfg.vocab_size
    cases = [(dict(good, top_k=2**31), "top_k"), (dict(good, top_k=vocab + 1), "top_k"),
             (dict(good, max_tokens=2**31), "max_tokens"),
             (dict(good, max_completion_tokens=2**40), "max_completion_tokens"),
             (dict(good, seed=2**63), "seed"), (dict(good, repetition_penalty=1e-30), "repetition_penalty"),
             (dict(good, use_beam_search=True, length_penalty=1e6), "length_penalty"),
             (dict(good, stop=["w9"] * 17), "stop"), (dict(good, n=17), "n")]
    for body, field in cases:
        err = assert_openai_error(httpx.post(base + "/v1/chat/completions", json=body), 422, field)
        assert err["param"] == field, err
    for prompt in ([1, 4, vocab], [1, 2**40]):
        err = assert_openai_error(httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": prompt}), 422)
        assert err["param"] == "prompt" and "vocabulary" in err["message"], err
    nan = b'{"model": "tiny", "messages": [{"role": "user", "content": "w7"}], "temperature": NaN}'
    err = assert_openai_error(httpx.post(base + "/v1/chat/completions", content=nan,
                                         headers={"content-type": "application/json"}), 422, "temperature")
    assert c.chat.completions.create(**good).choices[0].finish_reason in ("stop", "length")
    assert httpx.get(base + "/health").status_code == 200


def test_framework_errors_are_openai_json(server):
    base = server["base"]
    post = lambda content, ctype="application/json": httpx.post(base + "/v1/chat/completions", content=content,
                                                                headers={"content-type": ctype})
    assert_openai_error(post(b'{"model": "\xff\xfe"}'), 400, "invalid JSON")  # not UTF-8
    assert_openai_error(post(b"[" * 100_000 + b"]" * 100_000), 400, "invalid JSON")
    assert_openai_error(httpx.get(base + "/v1/nope"), 404, "/v1/nope")
    assert_openai_error(httpx.get(base + "/v1/chat/completions"), 405, "GET")
    assert_openai_error(post(b"model=tiny", "application/x-www-form-urlencoded"), 415, "application/json")
    for path in ("/docs", "/openapi.json"):  # off unless serve.enable_docs
        assert_openai_error(httpx.get(base + path), 404)
    # a body declared larger than serve.max_request_bytes: 413 at once, the rest never read (nor sent)
    limit = server["cfg"].serve.max_request_bytes
    sock = raw_request(base, b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d" % (limit + 1), b'{"model": ')
    with sock:
        status, body = read_response(sock)
    assert status == 413 and "serve.max_request_bytes" in body["error"]["message"], body


def test_abandoned_plain_request_stops_at_once_and_frees_its_pages(server):
    """A plain (not streamed) n=8 request of 55 tokens a choice on 4 sequence slots, whose client closes the
    connection while the first 4 choices decode (their outputs keep the handler busy): every choice is aborted
    then, the 4 waiting ones never start, the pages return and the log records 8 abandoned choices."""
    base, service, log = server["base"], server["service"], server["log"]
    logged = len(log.read_text().splitlines())
    body = json.dumps({"model": MODEL, "messages": user("w7 w9"), "max_tokens": 55, "n": 8,
                       "ignore_eos": True}).encode()
    thaw = hold_on_first_output(service)  # the client goes away before the running choices can finish
    sock = raw_request(base, b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d" % len(body), body)
    running = "mmjax:num_requests_running{sla_class=interactive}"
    waiting = "mmjax:num_requests_waiting{sla_class=interactive}"
    deadline = time.monotonic() + 30
    assert thaw.frozen.wait(30)
    steps = metrics(base)["mmjax:engine_steps_total"]
    sock.close()
    time.sleep(0.2)  # the handler's watcher sees the disconnect and aborts every choice (queued behind the hold)
    thaw.set()
    while (m := metrics(base))["mmjax:kv_cache_usage_perc"] > 0 or m[running] > 0 or m[waiting] > 0:
        assert time.monotonic() < deadline, m
        time.sleep(0.005)
    records = [json.loads(x) for x in log.read_text().splitlines()[logged:]]
    assert len(records) == 8 and all(r["status"] == 499 for r in records), [r["status"] for r in records]
    tokens = sorted(r.get("generated_tokens", 0) for r in records)
    assert tokens[:4] == [0] * 4 and max(tokens) < 55, tokens  # the waiting half never ran, none ran to the end
    assert metrics(base)["mmjax:engine_steps_total"] - steps < 55


def png_bytes(size=(12, 12), mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, "PNG")
    return buf.getvalue()


def test_local_media_only_regular_files_under_the_folder(server):
    base = server["base"]
    media = server["media"]
    root = media.parent
    (root / "outside.png").write_bytes(png_bytes())
    (media / "ok.png").write_bytes(png_bytes())
    (media / "link.png").symlink_to(root / "outside.png")
    (media / "dir.png").mkdir()
    (media / "notes.png").write_text("not an image")
    os.mkfifo(media / "pipe.png")
    chat = lambda url: httpx.post(base + "/v1/chat/completions", timeout=30, json=dict(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "w7"}]}]))
    assert chat(f"file://{media / 'ok.png'}").status_code == 200
    refused = [f"file://{media / name}" for name in ("missing.png", "link.png", "dir.png", "notes.png", "pipe.png")]
    refused += [f"file://{media}/../outside.png", f"file://{root / 'outside.png'}", "file:///dev/zero",
                "file:///etc/passwd", f"file://{media}"]
    messages = set()
    for url in refused:
        err = assert_openai_error(chat(url), 400)
        messages.add((err["message"], err["code"]))
        assert httpx.get(base + "/health").status_code == 200
    assert len(messages) == 1, messages  # one message: nothing about what exists on the server
    message, code = messages.pop()
    assert code == "invalid_local_media" and str(root) not in message


def test_image_too_large_is_refused_from_its_header(server):
    """A PNG of 5000 x 5000 pixels (a few KB compressed) is refused by serve.max_image_pixels before decoding."""
    data = png_bytes((5000, 5000), "L")
    assert len(data) < 100_000
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "w7"}]
    r = httpx.post(server["base"] + "/v1/chat/completions",
                   json=dict(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": content}]))
    err = assert_openai_error(r, 400, "5000 x 5000")
    assert err["code"] == "image_too_large" and "serve.max_image_pixels" in err["message"]


def test_unknown_fields_accepted_and_logged_once(server, caplog):
    caplog.set_level(logging.WARNING, logger="mmjax.serving.http.app")
    c = server["client"]
    for _ in range(2):
        r = c.chat.completions.create(model=MODEL, messages=user("w7"), max_tokens=2,
                                      extra_body={"some_future_field": {"x": 1}})
        assert r.choices[0].finish_reason in ("stop", "length")
    assert sum("some_future_field" in rec.getMessage() for rec in caplog.records) == 1


@pytest.fixture(scope="module")
def spare(run_dir):
    """A second engine for servers of their own configuration (API keys; an engine that fails)."""
    cfg, model, tok = load_for_serving(run_dir / "checkpoints", overrides=SERVE)
    return Engine(cfg, model, tok), tok, cfg


def test_api_keys(spare, monkeypatch):
    engine, tok, cfg = spare
    monkeypatch.setenv("MMJAX_API_KEY", "key-from-env")
    port = free_port()
    srv, service = make_server(engine, tok, dataclasses.replace(cfg.serve, port=port, api_key="key-a, key-b"), MODEL,
                               log_level="warning")
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, lambda: "")  # /ready, /health and /metrics need no key
        assert httpx.get(base + "/health").status_code == 200 and httpx.get(base + "/metrics").status_code == 200
        body = dict(model=MODEL, messages=user("w7"), max_tokens=2)
        err = assert_openai_error(httpx.post(base + "/v1/chat/completions", json=body), 401, "API key")
        assert err["code"] == "invalid_api_key"
        assert_openai_error(httpx.get(base + "/v1/models", headers={"Authorization": "Bearer key-c"}), 401)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).chat.completions.create(**body)
        for key in ("key-b", "key-from-env"):
            client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
            assert client.chat.completions.create(**body).choices[0].finish_reason in ("stop", "length")
        # local media are off by default: file:// is refused, saying how to enable it
        r = httpx.post(base + "/v1/chat/completions", headers={"Authorization": "Bearer key-a"}, json=dict(
            body, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]))
        assert assert_openai_error(r, 400, "serve.allowed_local_media_path")["code"] == "local_media_disabled"
    finally:
        srv.should_exit = True
        thread.join(10)
        service.stop()


def test_engine_failure_fails_in_flight_requests_and_exits_1(spare, monkeypatch):
    """A step failure no request caused (here: injected into the device step) ends the in-flight requests with
    a 500 / an SSE error event, /health turns 503 and `server.run` returns 1 without waiting for a drain."""
    from fastapi.testclient import TestClient

    from mmjax.serving.http import server as server_module

    engine, tok, cfg = spare
    broken = threading.Event()
    dispatch = engine.runner.dispatch

    def failing_dispatch(*args, **kwargs):
        if broken.is_set():
            raise RuntimeError("injected: the device step failed")
        time.sleep(0.01)  # steps slow enough that a loaded machine's /metrics polls see everything in flight
        return dispatch(*args, **kwargs)
    monkeypatch.setattr(engine.runner, "dispatch", failing_dispatch)
    made = {}
    make = server_module.make_server
    monkeypatch.setattr(server_module, "make_server", lambda *a, **k: made.setdefault("server", make(*a, **k)))
    port = free_port()
    serve = dataclasses.replace(cfg.serve, port=port, drain_timeout_s=600)
    result = {}
    thread = threading.Thread(target=lambda: result.update(code=server_module.run(engine, tok, serve, MODEL)),
                              daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, lambda: "" if thread.is_alive() else "server exited")
    srv, service = made["server"]
    body = {"model": MODEL, "messages": user("w7 w8"), "max_tokens": 55, "ignore_eos": True}
    # the stream's 16 choices of 55 tokens on 4 sequence slots are far from done when the plain request arrives
    with ThreadPoolExecutor(1) as pool, httpx.stream("POST", base + "/v1/chat/completions", timeout=60,
                                                     json={**body, "n": 16, "stream": True}) as stream:
        lines = stream.iter_lines()
        assert any('"content":"' in line and '"content":""' not in line for line in lines)
        plain = pool.submit(httpx.post, base + "/v1/chat/completions", json=body, timeout=60)
        count = lambda m: sum(m[f"mmjax:num_requests_{k}{{sla_class=interactive}}"] for k in ("running", "waiting"))
        deadline = time.monotonic() + 30
        while (seen := count(metrics(base))) < 16 + 1:  # every choice of the stream and the plain request in flight
            assert time.monotonic() < deadline and not plain.done(), seen
            time.sleep(0.005)
        thaw = hold(service)
        broken.set()
        thaw.set()
        rest = [line for line in lines if line.startswith("data: ")]
        plain = plain.result()
    err = assert_openai_error(plain, 500, "engine failed")
    assert err["type"] == "server_error"
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["error"]["code"] == "engine_failed", rest[-3:]
    thread.join(30)
    assert not thread.is_alive() and result["code"] == 1
    app = TestClient(srv.config.app)
    assert_openai_error(app.get("/health"), 503, "engine failed")
    assert_openai_error(app.post("/v1/completions", json={"model": MODEL, "prompt": "w7"}), 503, "engine failed")


def test_cli_model_takes_a_known_name_or_a_hugging_face_folder(hf_llama_dir, tmp_path, monkeypatch, capsys):
    from mmjax import serve
    from mmjax.serving import served_model

    monkeypatch.setenv("MMJAX_CACHE", str(tmp_path / "cache"))
    ckpt, tok, name = served_model.real_model(f"hf:{hf_llama_dir}")  # converted once into the cache, its own tokenizer
    assert ckpt.parent == tmp_path / "cache" / "hf_import" and (ckpt / "0").is_dir()
    assert name == hf_llama_dir.name and "<|start_header_id|>" in tok.chat_template
    assert served_model.real_model(str(hf_llama_dir))[0] == ckpt  # a folder with config.json, reused
    assert serve.main(["--model", "no-such-model"]) == 1
    assert "neither a known model (smollm2-135m-instruct) nor a Hugging Face folder" in capsys.readouterr().err


def test_engine_core_killed_mid_stream_fails_in_flight_requests_and_exits_1(run_dir, spare, monkeypatch, tmp_path):
    """serve.engine_process: the engine-core process dies (SIGKILL) with a stream and a plain request in flight;
    both end with a 500 naming the cause, /health turns 503 and the server returns 1. Before that, the core (a
    fresh interpreter) compiled into the configured persistent cache, so a restart does not compile again."""
    from fastapi.testclient import TestClient

    from mmjax.serving.http import server as server_module

    _, _, cfg = spare
    port = free_port()
    serve = dataclasses.replace(cfg.serve, port=port, drain_timeout_s=600, engine_process=True)
    xla_cache = tmp_path / "xla"
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # inherited by the core: keep every program
    parallel = dataclasses.replace(cfg.parallel, compilation_cache_dir=str(xla_cache))
    client = EngineCoreClient(ModelSource(dataclasses.replace(cfg, serve=serve, parallel=parallel),
                                           checkpoint=str(run_dir / "checkpoints")), serve)
    made = {}
    make = server_module.serve_service
    monkeypatch.setattr(server_module, "serve_service", lambda *a, **k: made.setdefault("server", make(*a, **k)))
    result = {}
    thread = threading.Thread(target=lambda: result.update(code=server_module.run_service(client, MODEL)),
                              daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, lambda: "" if thread.is_alive() else "server exited")
    assert any(xla_cache.iterdir()), "the engine core compiled without the configured persistent compilation cache"
    srv, _ = made["server"]
    # 16 choices x 55 tokens each on 4 sequence slots: far from done when the core dies
    body = {"model": MODEL, "messages": user("w7 w8"), "max_tokens": 55, "n": 16, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool, httpx.stream("POST", base + "/v1/chat/completions", timeout=60,
                                                     json={**body, "stream": True}) as stream:
        lines = stream.iter_lines()
        assert any('"content":"' in line and '"content":""' not in line for line in lines)
        plain = pool.submit(httpx.post, base + "/v1/chat/completions", json=body, timeout=60)
        waiting = "mmjax:num_requests_waiting{sla_class=interactive}"
        deadline = time.monotonic() + 30
        while metrics(base)[waiting] < 16 + 4:  # the plain request was admitted too
            assert time.monotonic() < deadline and not plain.done()
            time.sleep(0.005)
        hold(client)  # frozen with both requests in flight, then killed
        os.kill(client.pid, signal.SIGKILL)
        rest = [line for line in lines if line.startswith("data: ")]
        plain = plain.result()
    err = assert_openai_error(plain, 500, "engine failed")
    assert err["type"] == "server_error" and err["code"] == "engine_failed" and "SIGKILL" in err["message"], err
    event = json.loads(rest[-2][6:])["error"]
    assert rest[-1] == "data: [DONE]" and event["code"] == "engine_failed" and "SIGKILL" in event["message"], rest[-3:]
    thread.join(30)
    assert not thread.is_alive() and result["code"] == 1
    app = TestClient(srv.config.app)
    assert_openai_error(app.get("/health"), 503, "engine failed")
    assert_openai_error(app.post("/v1/completions", json={"model": MODEL, "prompt": "w7"}), 503, "engine failed")


def test_content_parts_render_on_their_own_lines():
    """An image part then a text part renders as the training records write them: the marker, a newline, the text."""
    turns, images = parse_messages([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_data_url()}}, {"type": "text", "text": "What color?"}]}],
        "<image>", max_images=4)
    assert turns == [{"role": "user", "content": "<image>\nWhat color?"}] and len(images) == 1
