"""The cluster router's rule without Ray: route keys of shared prefixes, the prefix choice and its load bound, the
least-loaded fallback, sticky sessions, a dead replica forgotten; the serve.* cluster keys' validation; and the
single-process server importing no Ray."""

import json
import subprocess
import sys

import pytest

from mmjax.config import load_config
from mmjax.errors import ConfigError
from mmjax.serving.cluster.router import PrefixRouter, RouteKey, route_key


def chat(system: str, question: str, **extra) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "system", "content": system},
                                                  {"role": "user", "content": question}], **extra}).encode()


def test_route_keys_share_the_blocks_of_a_shared_prefix():
    system = "you answer in w-words only; " * 8
    a, b = route_key(chat(system, "first question"), 16), route_key(chat(system, "another one entirely"), 16)
    shared = len(system) // 16
    assert len(a.blocks) >= shared and a.blocks[:shared] == b.blocks[:shared]
    assert a.blocks[len(a.blocks) - 1] != b.blocks[len(b.blocks) - 1]  # the different questions differ
    assert route_key(chat("other system prompt " * 8, "first question"), 16).blocks[0] != a.blocks[0]
    # images count by their reference; the session is `user` or the x-session-id header
    img = lambda url: json.dumps({"messages": [{"role": "user", "content": [  # noqa: E731
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "w" * 40}]}]}).encode()
    assert route_key(img("data:image/png;base64,AAAA"), 16).blocks != route_key(img("data:image/png;base64,BBBB"),
                                                                                  16).blocks
    assert route_key(chat("s", "u", user="alice"), 16).session == "alice"
    assert route_key(chat("s", "u", user="alice"), 16, {"x-session-id": "h"}).session == "h"
    assert route_key(b"not json", 16) == RouteKey() and route_key(b"[1, 2]", 16) == RouteKey()
    assert route_key(json.dumps({"prompt": [1, 2, 3] * 20}).encode(), 8).blocks  # token-id prompts too


def test_prefix_then_load_bound_then_least_loaded():
    router = PrefixRouter(prefix=True, max_imbalance=2)
    replicas = ["a", "b"]
    shared = RouteKey(("p1", "p2", "p3"))
    first, reason = router.route(replicas, shared)
    assert reason == "load"
    other = "b" if first == "a" else "a"
    # the same prefix follows the first request while its replica is within the bound
    for _ in range(2):
        assert router.route(replicas, RouteKey(("p1", "p2", "x"))) == (first, "prefix")
    assert router.in_flight(first) == 3
    # three more in flight than the other replica: past the bound, the least-loaded one serves
    assert router.route(replicas, shared) == (other, "load")
    for _ in range(3):
        router.finished(first)
    # an unrelated request goes to the least-loaded replica
    assert router.route(replicas, RouteKey(("q1",))) == (first, "load")
    assert router.reasons == {"load": 3, "prefix": 2}
    # `choose` alone changes nothing: Ray may send the request elsewhere, and `routed` records where
    assert router.choose(replicas, RouteKey(("q2",))) == router.choose(replicas, RouteKey(("q2",)))
    # routing off: load only
    plain = PrefixRouter(prefix=False)
    plain.route(replicas, shared)
    assert plain.route(replicas, shared)[1] == "load"


def test_idle_replicas_take_turns():
    router = PrefixRouter()
    seen = []
    for i in range(6):
        replica, _ = router.route(["a", "b", "c"], RouteKey((f"u{i}",)))
        router.finished(replica)
        seen.append(replica)
    assert seen == ["a", "b", "c", "a", "b", "c"]


def test_request_ids_keep_counts_right_when_completion_comes_first_or_an_attempt_is_rejected():
    router = PrefixRouter()
    key = RouteKey(("u",))
    router.finished("a", "r1")  # a quick request's completion reaches the router before its routing
    router.routed("a", key, "load", request_id="r1")
    assert router.in_flight("a") == 0
    router.routed("a", key, "load", request_id="r0")
    router.finished("a", "r2")  # r2 rejected by a (r0 still running there), then routed to b until it ends there
    router.routed("b", key, "load", request_id="r2")
    assert (router.in_flight("a"), router.in_flight("b")) == (1, 1)
    router.finished("a", "r0")
    assert router.choose(["a", "b"], RouteKey(("v",)))[0] == "a"
    router.finished("b", "r2")
    assert router.in_flight("b") == 0
    router.routed("b", key, "load", request_id="r3")
    router.forget("b")  # b died with r3 on it and comes back under the same name with r4
    router.routed("b", key, "load", request_id="r4")
    router.finished("b", "r3")  # the dead request's late completion takes nothing from r4's count
    assert router.in_flight("b") == 1


def test_sessions_stick_and_a_dead_replica_is_forgotten():
    router = PrefixRouter(max_imbalance=4)
    replicas = ["a", "b", "c"]
    home, _ = router.route(replicas, RouteKey(("x",), "alice"))
    for i in range(3):
        assert router.route(replicas, RouteKey((f"y{i}",), "alice")) == (home, "session")
    # a retry excludes the replica that failed; the session follows the retry's replica
    moved, _ = router.route(replicas, RouteKey(("x",), "alice"), exclude=[home])
    assert moved != home
    assert router.route(replicas, RouteKey(("w",), "alice")) == (moved, "session")
    # a dead replica's prefixes and sessions are forgotten
    router.forget(moved)
    assert router.route([r for r in replicas if r != moved], RouteKey(("w",), "alice"))[1] == "load"


@pytest.mark.parametrize("override, key", [
    ("serve.replicas=-1", "serve.replicas"), ("serve.router_block_chars=0", "serve.router_block_chars"),
    ("serve.max_replicas=2 serve.min_replicas=3", "serve.min_replicas"),
    ("serve.max_replicas=2 serve.replicas=4", "serve.replicas"),
    ("serve.router=random", "serve.router"), ("serve.router_retries=-1", "serve.router_retries"),
])
def test_cluster_keys_are_validated(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config([], override.split())


def test_single_process_server_imports_no_ray():
    code = ("import sys, mmjax.serve, mmjax.serving.http.server, mmjax.serving.served_model; "
            "mmjax.serve.parse_args([]); print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
