"""The Ray Serve application: ingress replicas running tokenmill's HTTP app, per model a deployment of engine
replicas, and the ledger the ingresses share.

    client ─HTTP─► Ray Serve's proxy ─► Ingress × M (api/'s create_app on RemoteEngines) ─handle─► EngineReplica × N
                                        parses, authenticates, tokenises, streams             routed by
                                              │ rate limits, usage, counts                      PrefixAffinityRouter
                                              ▼
                                        Ledger (one replica)

The ingress is the single-process server's app unchanged, so routes, auth, errors, limits and streaming are the same;
its engines are RemoteEngines (cluster/remote_engine.py), and what every ingress must agree on (rate limits, per-user
usage, the HTTP and completion counts /metrics shows) is kept by the ledger (cluster/ledger.py). Each ingress keeps
its own admission queue, and its router its own count of what it sent each replica. A request with several prompts
is split per prompt, each routed by its own first block (what the engine would do with them anyway: one engine
request per prompt).
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
from tokenmill.api.rate_limit import RateLimiter
from tokenmill.cluster.ledger import Ledger
from tokenmill.cluster.ledger_client import LedgerClient
from tokenmill.cluster.metrics import ReplicaCollector
from tokenmill.cluster.remote_engine import RemoteEngine
from tokenmill.cluster.replica import EngineReplica
from tokenmill.cluster.simulated import SimulatedReplica
from tokenmill.config import Config

APP_NAME = "tokenmill"
ROUTER = "tokenmill.cluster.router:PrefixAffinityRouter"  # imported by Ray where a handle routes (the ingress)
HEALTH_CHECK_PERIOD_S = 2.0  # how soon Ray Serve notices a replica whose engine loop died (a dead process: at once)
ROUTING_STATS_PERIOD_S = 1.0  # how stale the router's view of each replica's cached prefixes may be
INGRESS_MAX_ONGOING = 100_000  # the ingress takes every HTTP request; its own admission (api/admission.py) bounds them
# autoscaled ingresses: the requests in flight on each that the autoscaler aims at. An ingress's cost is mostly per
# streamed token, and a request lasts seconds, so the requests one core carries (docs/scaling.md) keep dozens in
# flight at once
INGRESS_TARGET_ONGOING = 32
LEDGER_MAX_ONGOING = 100_000  # every ingress's charges and pushes; each is answered at once


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
    ledger = serve.deployment(
        name="ledger",
        num_replicas=1,
        max_ongoing_requests=LEDGER_MAX_ONGOING,
        ray_actor_options={"num_cpus": 0},
    )(Ledger)
    ingress = serve.deployment(
        name="ingress",
        max_ongoing_requests=INGRESS_MAX_ONGOING,
        ray_actor_options={"num_cpus": 0},  # the cores are the engines'; the ingress is mostly waiting
        graceful_shutdown_timeout_s=config.shutdown_grace_s,
        **_ingress_replicas(config),
    )(Ingress)
    return ingress.bind(config, ledger.bind(config), *engines)


def _ingress_replicas(config: Config) -> dict[str, Any]:
    if config.max_ingress_replicas is None:
        return {"num_replicas": config.ingress_replicas}
    scaling = AutoscalingConfig(
        min_replicas=config.ingress_replicas,
        max_replicas=config.max_ingress_replicas,
        target_ongoing_requests=INGRESS_TARGET_ONGOING,
    )
    return {"autoscaling_config": scaling}


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
        # Ray places no more replicas on a host than it has cores for; a simulated one sleeps instead of computing
        ray_actor_options={"num_cpus": 0 if config.simulate_engine else threads},
        # every prompt the engine may run or queue; past it the router holds the request (the ingress's admission
        # refuses long before)
        max_ongoing_requests=config.max_num_seqs + config.max_waiting_requests,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_timeout_s=config.shutdown_grace_s,
        request_router_config=router,
        **replicas,
    )(SimulatedReplica if config.simulate_engine else EngineReplica)


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

    def __init__(self, config: Config, ledger: DeploymentHandle, *engines: DeploymentHandle) -> None:
        configure_logging(config.log_level, config.log_format)  # this process's lines, as the server's would be
        self.config = config
        self.ledger = ledger
        self.handles = engines

    async def __serve_build_asgi_app__(self) -> FastAPI:
        target = target_replicas(self.config)
        engines = [await RemoteEngine.connect(handle, target) for handle in self.handles]
        this = (serve.get_replica_context().replica_id.unique_id, os.getpid())
        client = LedgerClient(self.ledger, RateLimiter.from_config(self.config) is not None, this)
        app = create_app(engines, self.config, client.books)
        client.count_from(app.state.metrics.counted)
        app.state.metrics.registry.register(ReplicaCollector(engines))
        return app
