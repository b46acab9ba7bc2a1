"""Which replica serves a request: sticky user, then the longest routed prefix, then the least loaded.

A request's route key is its prompt cut into blocks (`serve.router_block_chars` characters of the messages'
roles, texts and image references), each block's hash chained to the previous one's, so equal hashes mean equal
prefixes. The router remembers, per replica, the block hashes it sent there (the prefixes that replica has
computed and, while its KV pool keeps them, has cached; a bounded LRU per replica). Its rule, per request:

1. a `user` (or `x-session-id` header) seen before goes back to its replica;
2. else the replica holding the longest run of the request's leading blocks (ties: the less loaded);
3. either choice stands only while that replica has at most `serve.router_max_imbalance` more requests in flight
   than the least-loaded one, so one hot prefix cannot pile every request onto one replica;
4. otherwise, or with no match, the least-loaded replica (fewest requests in flight; ties: the one that has
   waited longest for a request, so idle replicas take turns).

`choose` decides; `routed` records where the request went (Ray may send it to a later-ranked replica when the
chosen one is full), which is what the prefix memory, the sessions and the load counts follow.

This module holds no Ray: `ray_router.py` plugs it into Ray Serve's request routing. `ROUTING` is what the request
router and the ingress share in the ingress's process.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import threading
from collections.abc import Hashable, Sequence
from typing import Any

MAX_BLOCKS_PER_REPLICA = 65536  # block hashes remembered per replica (LRU): a few MB of keys
MAX_SESSIONS = 65536  # sticky users remembered (LRU)
ROUTE_BLOCKS = 32  # leading blocks of a prompt that count for routing: long enough for any shared system prompt


@dataclasses.dataclass(frozen=True)
class RouteKey:
    """What the router needs of a request: its prefix block hashes and its session (user) if any."""

    blocks: tuple[str, ...] = ()
    session: str = ""


def _prompt_text(body: dict[str, Any]) -> str:
    """A request's prompt as one string: chat roles, texts and image URLs in order, or the completion prompt."""
    if "messages" in body and isinstance(body["messages"], list):
        parts = []
        for m in body["messages"]:
            if not isinstance(m, dict):
                continue
            parts.append(f"\x00{m.get('role', '')}\x00")
            content = m.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                for p in content:
                    if not isinstance(p, dict):
                        continue
                    if p.get("type") == "text":
                        parts.append(str(p.get("text", "")))
                    elif p.get("type") == "image_url":
                        url = p.get("image_url")
                        url = url.get("url", "") if isinstance(url, dict) else str(url)
                        parts.append("\x01" + hashlib.sha1(url.encode()).hexdigest() + "\x01")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return " ".join(str(t) for t in prompt)
    return prompt if isinstance(prompt, str) else ""


def route_key(body_bytes: bytes, block_chars: int, headers: dict[str, str] | None = None) -> RouteKey:
    """The route key of a raw request body (a body that is not a JSON object routes by load alone)."""
    session = (headers or {}).get("x-session-id", "")
    try:
        body = json.loads(body_bytes) if body_bytes else {}
    except (ValueError, UnicodeDecodeError):
        return RouteKey(session=session)
    if not isinstance(body, dict):
        return RouteKey(session=session)
    if not session and isinstance(body.get("user"), str):
        session = body["user"]
    text = _prompt_text(body)
    blocks, h = [], hashlib.sha1()
    for i in range(0, min(len(text), block_chars * ROUTE_BLOCKS) - block_chars + 1, block_chars):
        h.update(text[i:i + block_chars].encode("utf-8", "surrogatepass"))
        blocks.append(h.hexdigest()[:16])
    return RouteKey(tuple(blocks), session)


class _LRU(collections.OrderedDict):
    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def touch(self, key: Hashable, value: Any = True) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.capacity:
            self.popitem(last=False)


class PrefixRouter:
    """The routing rule of the module docstring, over replicas named by string ids. Thread-safe."""

    def __init__(self, *, prefix: bool = True, max_imbalance: int = 8) -> None:
        self.prefix = prefix
        self.max_imbalance = max_imbalance
        self._blocks: dict[str, _LRU] = {}
        self._sessions = _LRU(MAX_SESSIONS)
        self._in_flight: dict[str, int] = collections.Counter()
        # with request ids (Ray's router): which replica each open request is on, and the (request, replica) pairs
        # whose completion came before their routing (a quick request's done-callback may fire first, and a rejected
        # attempt completes without being routed), so neither leaves a count behind
        self._open: dict[str, str] = {}
        self._done_unrouted = _LRU(MAX_SESSIONS)
        self._last_routed: dict[str, int] = {}  # replica -> when it last got a request (a running count)
        self._routed_count = 0
        self._lock = threading.Lock()
        self.reasons: dict[str, int] = collections.Counter()  # requests routed, by reason: session, prefix, load

    def in_flight(self, replica: str) -> int:
        return self._in_flight.get(replica, 0)

    def choose(self, replicas: Sequence[str], key: RouteKey, exclude: Sequence[str] = ()) -> tuple[str, str] | None:
        """(replica, reason) for a request, reason one of session / prefix / load; None when no replica is left.
        Changes nothing: `routed` records where the request went (Ray may send it further down the ranking)."""
        with self._lock:
            live = [r for r in replicas if r not in exclude] or list(replicas)
            if not live:
                return None
            # least loaded; among equals the one that waited longest for a request, so idle replicas take turns
            by_load = sorted(live, key=lambda r: (self.in_flight(r), self._last_routed.get(r, -1), r))
            least = by_load[0]
            bound = self.in_flight(least) + self.max_imbalance
            sticky = self._sessions.get(key.session) if key.session else None
            if sticky in live and self.in_flight(sticky) <= bound:
                return sticky, "session"
            if self.prefix and key.blocks:
                best, best_len = None, 0
                for r in by_load:  # the first of the longest matches: the least loaded of them
                    n = self._match(r, key.blocks)
                    if n > best_len:
                        best, best_len = r, n
                if best is not None and self.in_flight(best) <= bound:
                    return best, "prefix"
            return least, "load"

    def route(self, replicas: Sequence[str], key: RouteKey, exclude: Sequence[str] = ()) -> tuple[str, str] | None:
        """`choose`, then `routed` to the chosen replica (where nothing else decides)."""
        picked = self.choose(replicas, key, exclude)
        if picked is not None:
            self.routed(picked[0], key, picked[1])
        return picked

    def routed(self, replica: str, key: RouteKey, reason: str, request_id: str = "") -> None:
        """A request went to `replica`: it now holds the request's prefix, its session, and one more in flight
        (unless `finished` already saw this request end there)."""
        with self._lock:
            cached = self._blocks.setdefault(replica, _LRU(MAX_BLOCKS_PER_REPLICA))
            for b in key.blocks:
                cached.touch(b)
            if key.session:
                self._sessions.touch(key.session, replica)
            self._routed_count += 1
            self._last_routed[replica] = self._routed_count
            self.reasons[reason] += 1
            if request_id and self._done_unrouted.pop((request_id, replica), None) is not None:
                return
            if request_id:
                self._open[request_id] = replica
            self._in_flight[replica] += 1

    def _match(self, replica: str, blocks: Sequence[str]) -> int:
        cached = self._blocks.get(replica)
        if not cached:
            return 0
        n = 0
        for b in blocks:
            if b not in cached:
                break
            n += 1
        return n

    def finished(self, replica: str, request_id: str = "") -> None:
        """A request on `replica` ended. With its id, only a routed request's count is taken back."""
        with self._lock:
            if request_id:
                if self._open.get(request_id) != replica:
                    self._done_unrouted.touch((request_id, replica))
                    return
                del self._open[request_id]
            self._in_flight[replica] = max(0, self._in_flight[replica] - 1)

    def forget(self, replica: str) -> None:
        """A replica is gone: its cache went with it (a restarted one starts empty), and so do its sessions."""
        with self._lock:
            self._blocks.pop(replica, None)
            self._in_flight.pop(replica, None)
            self._last_routed.pop(replica, None)
            for request in [q for q, r in self._open.items() if r == replica]:
                del self._open[request]
            for user in [u for u, r in self._sessions.items() if r == replica]:
                del self._sessions[user]


class RoutingState:
    """The ingress process's view of the replicas (see the module docstring)."""

    def __init__(self) -> None:
        self.router = PrefixRouter()
        self.stats: dict[str, dict[str, Any]] = {}  # replica id -> its latest record_routing_stats
        self.attempts: collections.OrderedDict[str, str] = collections.OrderedDict()  # attempt id -> replica id
        self.retries = 0
        self.failures: dict[str, int] = collections.Counter()  # replica id -> requests failed by its death
        self.removed = 0  # replicas Ray reported dead
        self._lock = threading.Lock()

    def configure(self, prefix: bool, max_imbalance: int) -> None:
        self.router.prefix, self.router.max_imbalance = prefix, max_imbalance

    def note_attempt(self, attempt: str, replica: str) -> None:
        with self._lock:
            self.attempts[attempt] = replica
            while len(self.attempts) > MAX_SESSIONS:
                self.attempts.popitem(last=False)

    def replica_of(self, attempt: str) -> str | None:
        with self._lock:
            return self.attempts.pop(attempt, None)


ROUTING = RoutingState()
