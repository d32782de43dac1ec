"""The Ray Serve application: one ingress running tokenmill's HTTP app, and per model a deployment of engine replicas.

    client ─HTTP─► Ray Serve's proxy ─► Ingress (api/'s create_app on RemoteEngines) ─handle─► EngineReplica × N
                                        parses, authenticates, rate-limits, tokenises      routed by PrefixAffinityRouter

The ingress is the single-process server's app unchanged, so routes, auth, errors, limits and streaming are the same;
its engines are RemoteEngines (cluster/remote_engine.py). It is one replica: it holds the rate limiter, the admission
queue and the HTTP metrics for the whole deployment, and its router sees every request it sends. A request with
several prompts is split per prompt, each routed by its own first block (what the engine would do with them anyway:
one engine request per prompt).
"""

from __future__ import annotations

import os
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve.config import AutoscalingConfig
from ray.serve.deployment import Application
from ray.serve.handle import DeploymentHandle

from tokenmill.api.app import create_app
from tokenmill.api.logs import configure_logging
from tokenmill.cluster.metrics import ReplicaCollector
from tokenmill.cluster.remote_engine import RemoteEngine
from tokenmill.cluster.replica import EngineReplica
from tokenmill.config import Config

APP_NAME = "tokenmill"
ROUTER = "tokenmill.cluster.router:PrefixAffinityRouter"  # imported by Ray where a handle routes (the ingress)
HEALTH_CHECK_PERIOD_S = 2.0  # how soon Ray Serve notices a replica whose engine loop died (a dead process: at once)
ROUTING_STATS_PERIOD_S = 1.0  # how stale the router's view of each replica's cached prefixes may be
INGRESS_MAX_ONGOING = 100_000  # the ingress takes every HTTP request; its own admission (api/admission.py) bounds them


def most_replicas(config: Config) -> int:
    """The most replicas of one model that may run: --max-replicas when autoscaled, else --replicas."""
    return config.max_replicas or config.replicas or 1


def replica_threads(config: Config, cpus: int | None = None) -> int:
    """Each replica's intra-op threads: --threads, else this host's cores shared by the replicas it may hold."""
    if config.threads:
        return config.threads
    return max(1, (cpus or os.cpu_count() or 1) // most_replicas(config))


def target_replicas(config: Config) -> int:
    """How many replicas of a model should be running: below it /health says degraded."""
    if config.max_replicas is not None:
        return config.min_replicas or 1
    return config.replicas or 1


def engine_name(index: int) -> str:
    """The deployment of the index-th model's engine replicas."""
    return "engine" if index == 0 else f"engine-{index}"


def build_app(config: Config) -> Application:
    threads = replica_threads(config)
    engines = [
        _engine_deployment(one, i, threads).bind(one.with_overrides(threads=threads))
        for i, one in enumerate(config.per_model())
    ]
    ingress = serve.deployment(
        name="ingress",
        num_replicas=1,
        max_ongoing_requests=INGRESS_MAX_ONGOING,
        ray_actor_options={"num_cpus": 0},  # the cores are the engines'; the ingress is mostly waiting
        graceful_shutdown_timeout_s=config.shutdown_grace_s,
    )(Ingress)
    return ingress.bind(config, *engines)


def from_args(args: dict[str, Any]) -> Application:
    """The application from a Serve config file's `args` (KubeRay's RayService, `serve run`, `serve deploy`): the
    same settings as the flags, by their field names (`model`, `replicas`, `api_key`, ...; lists for repeatable
    ones). Listening host and port are the config file's `http_options`, not these."""
    settings: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in args.items()}
    return build_app(Config(**settings))


def _engine_deployment(config: Config, index: int, threads: int) -> Any:
    router = {  # RequestRouterConfig's fields
        "request_router_class": ROUTER,
        "request_router_kwargs": {"block_size": config.block_size, "affinity": config.prefix_affinity},
        # how often each replica tells the router which prefix blocks it holds (EngineReplica.record_routing_stats)
        "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
    }
    replicas: dict[str, Any] = {"num_replicas": config.replicas or 1}
    if config.max_replicas is not None:
        replicas = {"autoscaling_config": _autoscaling(config)}
    return serve.deployment(
        name=engine_name(index),
        ray_actor_options={"num_cpus": threads},  # Ray places no more replicas on a host than it has cores for
        # every prompt the engine may run or queue; past it the router holds the request (the ingress's admission
        # refuses long before)
        max_ongoing_requests=config.max_num_seqs + config.max_waiting_requests,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_timeout_s=config.shutdown_grace_s,
        request_router_config=router,
        **replicas,
    )(EngineReplica)


def _autoscaling(config: Config) -> AutoscalingConfig:
    settings: dict[str, Any] = {"min_replicas": config.min_replicas or 1, "max_replicas": config.max_replicas}
    if config.replicas is not None:
        settings["initial_replicas"] = config.replicas
    if config.target_ongoing_requests is not None:
        settings["target_ongoing_requests"] = config.target_ongoing_requests
    return AutoscalingConfig(**settings)


@serve.ingress()
class Ingress:
    """tokenmill's FastAPI app, built once the engine replicas say what they serve."""

    def __init__(self, config: Config, *engines: DeploymentHandle) -> None:
        configure_logging(config.log_level, config.log_format)  # this process's lines, as the server's would be
        self.config = config
        self.handles = engines

    async def __serve_build_asgi_app__(self) -> FastAPI:
        target = target_replicas(self.config)
        engines = [await RemoteEngine.connect(handle, target) for handle in self.handles]
        app = create_app(engines, self.config)
        app.state.metrics.registry.register(ReplicaCollector(engines))
        return app
