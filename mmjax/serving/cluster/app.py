"""The Ray Serve application: `Ingress` over `EngineReplica`s, sized and routed by the config's `serve.*` keys.

`build_cluster_app(spec)` is what `python -m mmjax.serve --replicas N` runs; `app_builder` is the same for people
who deploy Ray Serve applications themselves:

    serve run mmjax.serving.cluster.app:app_builder config=serve/tiny_shapes.yaml checkpoint=runs/tiny_shapes \\
        overrides="serve.replicas=2"

(or `import_path: mmjax.serving.cluster.app:app_builder` with these `args:` in a Ray Serve config file, as the
KubeRay example in docs/serving.md does).
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.deployment import Application

from mmjax.config import ServeConfig
from mmjax.serving.cluster.ingress import Ingress
from mmjax.serving.cluster.ray_router import PrefixAwareRequestRouter
from mmjax.serving.cluster.replica import EngineReplica
from mmjax.serving.cluster.spec import EngineSpec

ROUTING_STATS_PERIOD_S = 1.0  # how often Ray asks each replica for its load and metrics
HEALTH_CHECK_PERIOD_S = 2.0  # how often Ray checks a replica (a failed engine is replaced this fast)
REPLICA_START_TIMEOUT_S = 1800  # Ray gives a replica this long to load and warm up before replacing it


def replica_options(serve_cfg: ServeConfig, tensor: int) -> dict[str, Any]:
    """Ray Serve options of the engine deployment: count or autoscaling bounds, resources, routing."""
    gpus = serve_cfg.replica_gpus
    opts: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": serve_cfg.replica_cpus, "num_gpus": gpus * tensor if gpus else 0},
        # what one replica may hold: the engine's queue plus its running batch (admission refuses past that)
        "max_ongoing_requests": serve_cfg.max_queue_len + serve_cfg.max_num_seqs,
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "graceful_shutdown_timeout_s": serve_cfg.drain_timeout_s,
        "request_router_config": RequestRouterConfig(
            request_router_class=PrefixAwareRequestRouter,
            request_router_kwargs={"prefix": serve_cfg.router == "prefix",
                                   "max_imbalance": serve_cfg.router_max_imbalance},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S),
    }
    if serve_cfg.max_replicas > 0:
        opts["autoscaling_config"] = AutoscalingConfig(
            min_replicas=serve_cfg.min_replicas, max_replicas=serve_cfg.max_replicas,
            initial_replicas=max(serve_cfg.replicas, serve_cfg.min_replicas),
            target_ongoing_requests=serve_cfg.target_ongoing_requests)
    else:
        opts["num_replicas"] = max(serve_cfg.replicas, 1)
    return opts


def build_cluster_app(spec: EngineSpec) -> Application:
    cfg = spec.config()
    replicas = serve.deployment(EngineReplica, name="EngineReplica", **replica_options(cfg.serve, cfg.mesh.tensor))
    ingress = serve.deployment(Ingress, name="Ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=100_000)
    return ingress.bind(replicas.bind(spec), spec)


def app_builder(args: dict[str, Any]) -> Application:
    """`serve run` / Ray Serve config files: the application of `EngineSpec.from_args(args)`."""
    return build_cluster_app(EngineSpec.from_args(args))
