"""`tokenmill serve --replicas N`: start (or join) Ray, run the application (cluster/app.py), serve until a signal.

A local Ray instance binds to 127.0.0.1 alone and has no dashboard: everything it starts listens on loopback, like
the single-process server. `--ray-address` joins an existing cluster instead (`ray start --head` on one machine,
`ray start --address=HEAD:6379` on the others, or a KubeRay RayCluster: docs/scaling.md); its Serve proxy then listens
where that cluster's Serve was started (or on --host/--port if this is the first Serve application on it).

SIGTERM or SIGINT deletes the application, which gives each replica `--shutdown-grace-s` to finish what it runs; if
this process started Ray, Serve and Ray stop too (a cluster it joined keeps running).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading

import ray
from ray import serve

from tokenmill.cluster.app import APP_NAME, build_app, engine_name, most_replicas, replica_threads, target_replicas
from tokenmill.cluster.remote_engine import RemoteEngine
from tokenmill.config import Config
from tokenmill.engine.content_filter import ContentFilter
from tokenmill.server.banner import log_banner, url_of

log = logging.getLogger(__name__)


def serve_on_ray(config: Config) -> int:
    if config.content_filter:  # a bad filter file fails the start before any replica loads a model
        ContentFilter.from_file(config.content_filter)
    started_ray = _init_ray(config)
    stop = _stop_on_signal()  # after ray.init, which installs handlers of its own
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        _banner(config)
        while not stop.wait(1.0):
            pass
        log.info("stopping: each replica has %.0f s to finish what it runs", config.shutdown_grace_s)
        serve.delete(APP_NAME)
        if started_ray:  # on a cluster we joined, Serve (and its other applications) stays up
            serve.shutdown()
    finally:
        if started_ray:
            ray.shutdown()
    return 0


def _init_ray(config: Config) -> bool:
    """Join the cluster named, else start a local instance sized so every replica fits; True if this started it."""
    if config.ray_address:
        ray.init(address=config.ray_address, log_to_driver=True)
        return False
    cores = os.cpu_count() or 1
    threads = replica_threads(config, cores)
    wanted = 0 if config.simulate_engine else threads * most_replicas(config) * len(config.per_model())
    if wanted > cores:
        log.warning("%d replica threads on %d cores: the replicas will share cores and slow each other", wanted, cores)
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=max(cores, wanted))
    return True


def _banner(config: Config) -> None:
    async def describe() -> list[RemoteEngine]:
        models = range(len(config.per_model()))
        handles = [serve.get_deployment_handle(engine_name(i), APP_NAME) for i in models]
        return [await RemoteEngine.connect(handle, target_replicas(config)) for handle in handles]

    engines = asyncio.run(describe())
    log_banner(url_of(config.host, config.port), engines, with_key=bool(config.api_key))
    log.info(
        "on Ray Serve: %s replica(s) of each model, %d thread(s) each, prefix-affinity routing %s",
        _replica_count(config),
        replica_threads(config),
        "on" if config.prefix_affinity else "off",
    )


def _replica_count(config: Config) -> str:
    if config.max_replicas is None:
        return str(config.replicas or 1)
    return f"{config.min_replicas or 1}-{config.max_replicas} (autoscaled)"


def _stop_on_signal() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    return stop
