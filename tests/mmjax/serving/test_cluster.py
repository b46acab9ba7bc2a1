"""The Ray Serve cluster on one local Ray with 2 replicas of the tiny model (one shared fixture), driven with the
official `openai` client: the same answers, streams and errors as the single server; shared-prefix requests on
one replica (its prefix-cache hits rise, the other's do not); unrelated requests over both; sticky users; a
replica killed mid-load loses no request (each retried) and Ray brings it back. Also tensor-parallel serving
(`mesh.tensor=2` on the simulated CPU devices) giving one device's greedy tokens."""

import base64
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jax
import openai
import pytest
from test_server import SERVE, free_port, metrics, png_data_url, write_run

from mmjax.config import load_config
from mmjax.serving.request import SamplingParams
from mmjax.serving.served_model import load_served

ray = pytest.importorskip("ray", reason="the cluster extra (pip install -e '.[cluster]')")
from ray import serve  # noqa: E402

from mmjax.serving.cluster.launch import APP_NAME, start_cluster  # noqa: E402
from mmjax.serving.cluster.spec import EngineSpec  # noqa: E402

pytestmark = pytest.mark.multiprocess
MODEL = "tiny"
PROMPT = [1, 4, 7, 8, 9, 10, 5]  # <|bos|> <|user|> w7 w8 w9 w10 <|assistant|>
CLUSTER = ["serve.model_name=tiny", "serve.replicas=2", "serve.replica_cpus=0.5", "serve.router_block_chars=16",
           "serve.max_num_seqs=4", "serve.min_slot_bucket=4"]


@pytest.fixture(scope="module")
def run_dir(tiny, tmp_path_factory):
    return write_run(tmp_path_factory.mktemp("cluster"), tiny)


@pytest.fixture(scope="module")
def offline(run_dir):
    """One device's greedy tokens and text for PROMPT and a second prompt (the single server's engine)."""
    served = load_served(load_config([], SERVE), str(run_dir), overrides=SERVE)
    return greedy(served.engine) | {"tokenizer": served.tokenizer}


def greedy(engine) -> dict:
    prompts = {"a": PROMPT, "b": [1, 4, 11, 12, 13, 14, 15, 5]}
    for rid, p in prompts.items():
        engine.add_request(p, None, SamplingParams(max_tokens=12), request_id=rid)
    tokens, text = {rid: [] for rid in prompts}, {rid: "" for rid in prompts}
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
            text[o.request_id] += o.new_text
    return {"tokens": tokens, "text": text}


@pytest.fixture(scope="module")
def cluster(run_dir, offline):
    port = free_port()
    spec = EngineSpec(configs=(), overrides=(*SERVE, *CLUSTER, f"serve.port={port}"), checkpoint=str(run_dir))
    start_cluster(spec, spec.config())
    base = f"http://127.0.0.1:{port}"
    yield dict(base=base, client=openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0))
    serve.shutdown()
    ray.shutdown()


def replicas(base) -> dict:
    return httpx.get(base + "/cluster/replicas").json()


def hits(base) -> dict[str, float]:
    """Each replica's prefix-cache hits, as the ingress last heard (Ray polls the replicas every second)."""
    return {k.split("replica=")[1].split(",")[0].rstrip("}"): v for k, v in metrics(base).items()
            if k.startswith("mmjax:prefix_cache_hits_total{")}


def served_by(c, **kw) -> str:
    r = c.chat.completions.with_raw_response.create(model=MODEL, max_tokens=2, temperature=0, **kw)
    assert r.status_code == 200
    return r.headers["x-mmjax-replica"]


def test_cluster_answers_like_the_single_server(cluster, offline):
    c = cluster["client"]
    assert [m.id for m in c.models.list().data] == [MODEL]
    r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].text == offline["text"]["a"]
    messages = [{"role": "system", "content": "w20"},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_url()}},
                                             {"type": "text", "text": "w9 w11"}]}]
    whole = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.usage.prompt_tokens == 1 + 2 + 1 + 4 + 2 + 1  # as the single server counts the image's tokens
    broken = "data:image/png;base64," + base64.b64encode(b"not an image").decode()
    messages[1]["content"][0]["image_url"]["url"] = broken
    with pytest.raises(openai.BadRequestError, match="decode"):
        c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    with pytest.raises(openai.NotFoundError, match="does not exist"):  # the replica app's own errors, unchanged
        c.completions.create(model="other", prompt="w7", max_tokens=2)
    assert httpx.get(cluster["base"] + "/ready").status_code == 200


def test_shared_prefix_goes_to_one_replica_and_hits_its_cache(cluster):
    c, base = cluster["client"], cluster["base"]
    system = "w30 w31 w32 w33 w34 w35 w36 w37 w38 w39 w40 w41 w42 w43 w44 w45 w46 w47"
    time.sleep(1.5)  # the earlier tests' requests reach the ingress's stats (Ray polls every second)
    deadline = time.monotonic() + 30
    while len(before := hits(base)) < 2:
        assert time.monotonic() < deadline, "replica stats never reached the ingress"
        time.sleep(0.5)
    homes = {served_by(c, messages=[{"role": "system", "content": system}, {"role": "user", "content": f"w{50 + i}"}])
             for i in range(5)}
    assert len(homes) == 1
    home = homes.pop()
    other = next(r for r in before if r != home)
    while (after := hits(base))[home] <= before[home]:
        assert time.monotonic() < deadline + 30, "the shared prefix's replica reported no prefix-cache hits"
        time.sleep(0.5)
    time.sleep(1.5)  # one more stats poll: the other replica's counter must not have moved
    after = hits(base)
    assert after[home] >= before[home] + 4 * 16 and after[other] == before[other]
    assert metrics(base)['mmjax:router_requests_routed_total{reason=prefix}'] >= 4


def test_unrelated_requests_spread_and_users_stick(cluster):
    c = cluster["client"]
    spread = {served_by(c, messages=[{"role": "user", "content": f"w{10 + i} w{20 + i} w{30 + i} w{40 + i} w{50 + i}"}])
              for i in range(6)}
    assert len(spread) == 2
    sticky = {served_by(c, messages=[{"role": "user", "content": f"w{20 + i} w{9 + i}"}], user="alice")
              for i in range(4)}
    assert len(sticky) == 1


def test_killed_replica_loses_no_unstarted_request_and_comes_back(cluster):
    c, base = cluster["client"], cluster["base"]
    before = replicas(base)
    victim = sorted(before.values(), key=lambda s: s["replica"])[0]

    def ask(i):
        r = c.completions.create(model=MODEL, prompt=f"w{7 + i % 40} w8 w9", max_tokens=40, temperature=0,
                                 extra_body={"ignore_eos": True})
        return r.usage.completion_tokens

    in_flight = f"mmjax:router_requests_in_flight{{replica={victim['replica']}}}"
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(ask, i) for i in range(32)]
        deadline = time.monotonic() + 60
        # kill it while it holds a backlog: the gauge is read over HTTP (a few hundred ms old on a loaded CI
        # machine), and a replica holding only one or two short requests may have answered them by the kill
        while metrics(base).get(in_flight, 0) < 4:
            assert time.monotonic() < deadline and not all(f.done() for f in futures), "no load on the replica"
            time.sleep(0.02)
        os.kill(victim["pid"], signal.SIGKILL)
        answered = [f.result(timeout=120) for f in futures]
    assert answered == [40] * 32
    m = metrics(base)
    assert m["mmjax:router_retries_total"] >= 1  # the killed replica's requests were sent again
    deadline = time.monotonic() + 180
    while True:  # Ray starts a new replica; it is back once it serves
        status = serve.status().applications[APP_NAME].deployments["EngineReplica"].replica_states
        now = replicas(base)
        pids = {s.get("pid") for s in now.values()}  # a new replica has no stats until its first report
        if status.get("RUNNING") == 2 and len(now) == 2 and None not in pids and victim["pid"] not in pids:
            break
        assert time.monotonic() < deadline, f"no replacement replica: {status}"
        time.sleep(1)
    served, i = set(), 0
    while served != set(now):  # unrelated requests spread: the replacement takes its share once the router sees it
        assert i < 48, f"48 unrelated requests reached only {served} of {set(now)}"
        served.add(served_by(c, messages=[{"role": "user", "content": f"w{11 + i} w{33 + i}"}]))
        i += 1


def test_tensor_parallel_serving_equals_one_device(run_dir, offline):
    assert len(jax.devices()) >= 2
    overrides = [*SERVE, "mesh.tensor=2"]
    served = load_served(load_config([], overrides), str(run_dir), overrides=overrides)
    assert "tensor parallel" in served.source
    split = [x for x in jax.tree.leaves(served.engine.runner.state) if "tensor" in str(x.sharding.spec)]
    assert split and all(len(x.sharding.device_set) == 2 for x in split)
    assert greedy(served.engine)["tokens"] == offline["tokens"]
