"""`PrefixRouter` as Ray Serve's request router of the engine replicas, and what it shares with the ingress.

Ray Serve creates the request router inside the process that holds the replicas' handle (the ingress replica),
so it and the ingress share `router.ROUTING`: the routing rule, each replica's latest stats
(`EngineReplica.record_routing_stats`, which Ray polls), which replica each attempt went to (so a failed one is
excluded from its retry), and the counters `/metrics` reports. Ray ships this module to that process by value
(a copy of its globals), so the shared state is reached through the `router` module, which travels by name.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from mmjax.serving.cluster import router as routing
from mmjax.serving.cluster.router import RouteKey


def _id(replica_id: ReplicaID) -> str:
    return replica_id.unique_id


class PrefixAwareRequestRouter(RequestRouter):
    """Ranks the candidates: the `PrefixRouter`'s choice first, then the rest by requests in flight (Ray sends the
    request to the first rank whose replica has room under its max_ongoing_requests)."""

    def initialize_state(self, prefix: bool = True, max_imbalance: int = 8, **_: Any) -> None:
        routing.ROUTING.configure(prefix, max_imbalance)
        self._choices: dict[str, tuple[str, str, RouteKey]] = {}  # Ray's request id -> (replica, reason, key)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {_id(r.replica_id) for r in replicas}
        for r in replicas:
            routing.ROUTING.stats[_id(r.replica_id)] = dict(r.routing_stats or {})
        for gone in set(routing.ROUTING.stats) - live:
            routing.ROUTING.stats.pop(gone, None)
            routing.ROUTING.router.forget(gone)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {_id(r.replica_id): r for r in candidate_replicas}
        for rid, r in by_id.items():
            if r.routing_stats:
                routing.ROUTING.stats[rid] = dict(r.routing_stats)
        route = (pending_request.kwargs.get("route") if pending_request is not None else None) or {}
        key = RouteKey(tuple(route.get("blocks", ())), route.get("session", ""))
        exclude = route.get("exclude", ())
        picked = routing.ROUTING.router.choose(sorted(by_id), key, exclude=exclude)
        if picked is None:
            return []
        if pending_request is not None:
            self._choices[pending_request.metadata.internal_request_id] = (*picked, key)
            while len(self._choices) > routing.MAX_SESSIONS:  # requests cancelled before Ray sent them
                self._choices.pop(next(iter(self._choices)))
        rest = sorted((r for rid, r in by_id.items() if rid != picked[0] and rid not in exclude),
                      key=lambda r: routing.ROUTING.router.in_flight(_id(r.replica_id)))
        return [[by_id[picked[0]]], rest] if rest else [[by_id[picked[0]]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        rid = _id(replica_id)
        chosen, reason, key = self._choices.pop(pending_request.metadata.internal_request_id, (rid, "load", RouteKey()))
        routing.ROUTING.router.routed(rid, key, reason if rid == chosen else "load",
                                      request_id=pending_request.metadata.internal_request_id)
        attempt = (pending_request.kwargs.get("route") or {}).get("attempt", "")
        if attempt:
            routing.ROUTING.note_attempt(attempt, rid)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        routing.ROUTING.router.finished(_id(replica_id), internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        routing.ROUTING.removed += 1
        routing.ROUTING.router.forget(_id(replica_id))
        routing.ROUTING.stats.pop(_id(replica_id), None)
