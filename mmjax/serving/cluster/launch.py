"""`python -m mmjax.serve --replicas N`: start (or join) Ray, deploy the cluster application, serve until stopped.

`serve.cluster_address` "" starts a local Ray for this process (its workers import this same mmjax); "auto" or an
address joins a running cluster (`ray start --head` first; every node needs mmjax and the checkpoint). SIGTERM or
SIGINT shuts the application down (Ray drains each replica for `serve.drain_timeout_s`) and returns 0.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

import ray
from ray import serve

from mmjax.config import Config
from mmjax.serving.cluster.app import build_cluster_app
from mmjax.serving.cluster.spec import EngineSpec

log = logging.getLogger(__name__)

APP_NAME = "mmjax"


def init_ray(cfg: Config) -> None:
    """Join `serve.cluster_address`, or start a local Ray with room for every replica."""
    if ray.is_initialized():
        return
    address = cfg.serve.cluster_address
    if address:
        ray.init(address=address)
        return
    source = str(Path(__file__).resolve().parents[3])  # the folder holding this mmjax: local workers import it
    path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH", "")) if p)
    replicas = max(cfg.serve.replicas, cfg.serve.max_replicas, 1)
    cpus = max(os.cpu_count() or 1, int(replicas * cfg.serve.replica_cpus + 0.999))
    ray.init(num_cpus=cpus, runtime_env={"env_vars": {"PYTHONPATH": path}}, include_dashboard=False)


def start_cluster(spec: EngineSpec, cfg: Config) -> Any:
    """Deploy the application on Ray (started or joined first) and return once every replica is ready; its HTTP
    endpoint is serve.host:serve.port."""
    init_ray(cfg)
    serve.start(http_options={"host": cfg.serve.host, "port": cfg.serve.port})
    return serve.run(build_cluster_app(spec), name=APP_NAME, route_prefix="/")


def run_cluster(spec: EngineSpec, cfg: Config) -> int:
    """Serve until SIGTERM/SIGINT; 0 after a clean shutdown."""
    start_cluster(spec, cfg)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs handlers of its own
        signal.signal(sig, lambda *_: stop.set())
    log.info("serving %d replica(s) on http://%s:%d (Ray Serve application %r)", max(cfg.serve.replicas, 1),
             cfg.serve.host, cfg.serve.port, APP_NAME)
    stop.wait()
    log.info("shutting down the cluster application")
    serve.delete(APP_NAME)
    serve.shutdown()
    ray.shutdown()
    return 0
