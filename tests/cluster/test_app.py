"""The Serve application as built from the flags (no Ray cluster needed to build it), and the single-process path
staying free of Ray."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.serve.deployment import Application

from tokenmill.cluster.app import (
    INGRESS_TARGET_ONGOING,
    ROUTER,
    build_app,
    engine_name,
    from_args,
    replica_threads,
    target_replicas,
)
from tokenmill.config import Config, ConfigError


def deployments(config: Config | Application) -> tuple[Any, list[Any]]:
    """The ingress deployment and the engine deployments it is bound to."""
    app = build_app(config) if isinstance(config, Config) else config
    ingress = app._bound_deployment
    return ingress, [arg._bound_deployment for arg in ingress.init_args[2:]]


def test_replicas_of_one_model_behind_one_ingress() -> None:
    ingress, (engine,) = deployments(Config(model=("m.gguf",), replicas=2, threads=1))
    assert (ingress.name, ingress.num_replicas, ingress.ray_actor_options["num_cpus"]) == ("ingress", 1, 0)
    assert (engine.name, engine.num_replicas, engine.ray_actor_options["num_cpus"]) == ("engine", 2, 1)
    router = engine._deployment_config.request_router_config
    assert router.request_router_class == ROUTER
    assert router.request_router_kwargs == {"block_size": 16, "affinity": True}
    assert engine.init_args[0].threads == 1  # the replica's own config pins its threads


def test_every_ingress_shares_one_ledger_and_ingresses_scale_like_engines() -> None:
    app = build_app(Config(replicas=2, ingress_replicas=3, threads=1))
    ingress = app._bound_deployment
    ledger = ingress.init_args[1]._bound_deployment
    assert (ingress.num_replicas, ledger.name, ledger.num_replicas, ledger.ray_actor_options["num_cpus"]) == (
        3,
        "ledger",
        1,
        0,
    )
    scaled, _ = deployments(Config(replicas=2, ingress_replicas=2, max_ingress_replicas=6, threads=1))
    scaling = scaled._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas) == (2, 6)
    assert scaling.target_ongoing_requests == INGRESS_TARGET_ONGOING


def test_every_model_gets_its_own_deployment() -> None:
    _, engines = deployments(Config(model=("a=x.gguf", "b=y.gguf"), replicas=3, prefix_affinity=False))
    assert [e.name for e in engines] == [engine_name(0), engine_name(1)] == ["engine", "engine-1"]
    assert [e.init_args[0].served_model_name for e in engines] == [("a",), ("b",)]
    assert not engines[0]._deployment_config.request_router_config.request_router_kwargs["affinity"]


def test_autoscaling_settings_pass_through_to_ray_serve() -> None:
    config = Config(replicas=2, min_replicas=1, max_replicas=4, target_ongoing_requests=3.0, threads=1)
    _, (engine,) = deployments(config)
    scaling = engine._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.initial_replicas, scaling.max_replicas) == (1, 2, 4)
    assert scaling.target_ongoing_requests == 3.0
    assert target_replicas(config) == 1  # degraded means below what the autoscaler must keep


def test_each_replica_gets_its_share_of_the_cores() -> None:
    assert replica_threads(Config(replicas=2), cpus=8) == 4
    assert replica_threads(Config(replicas=3), cpus=2) == 1
    assert replica_threads(Config(max_replicas=4), cpus=16) == 4
    assert replica_threads(Config(replicas=2, threads=3), cpus=16) == 3
    assert target_replicas(Config(replicas=5)) == 5


@pytest.mark.parametrize(
    "settings",
    [
        {"replicas": 0},
        {"min_replicas": 2},
        {"target_ongoing_requests": 2.0},
        {"min_replicas": 3, "max_replicas": 2},
        {"ingress_replicas": 0},
        {"ingress_replicas": 3, "max_ingress_replicas": 2},
        {"simulate_engine": True},
        {"replicas": 2, "simulated_service_times": "0.04,0.003,0.006"},
        {"replicas": 2, "simulate_engine": True, "simulated_service_times": "0.04,0.003"},
        {"replicas": 2, "simulate_engine": True, "simulated_service_times": "0.04,-1,0.006"},
    ],
)
def test_bad_replica_settings_fail_at_start(settings: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        Config(**settings)


def test_ray_is_wanted_only_when_asked_for() -> None:
    assert not Config().on_ray
    assert Config(replicas=1).on_ray and Config(max_replicas=2).on_ray and Config(ray_address="auto").on_ray
    assert Config(ingress_replicas=2).on_ray and Config(max_ingress_replicas=2).on_ray


def test_the_single_process_server_never_imports_ray() -> None:
    code = (
        "import sys\n"
        "from tokenmill.cli import main\n"
        "from tokenmill.api.app import create_app\n"
        "from tokenmill.engine.engine import AsyncEngine\n"
        "from tokenmill.server.load import load_engine\n"
        "from tokenmill.server.start import serve_forever\n"
        "from tokenmill.server.http_server import serve\n"
        "assert not [m for m in sys.modules if m == 'ray' or m.startswith('ray.')], 'ray was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_serve_config_file_builds_the_same_application() -> None:
    args = {"model": ["a=x.gguf"], "replicas": 2, "threads": 1, "api_key": ["k"]}
    ingress, (engine,) = deployments(from_args(args))
    assert ingress.init_args[0] == Config(model=("a=x.gguf",), replicas=2, threads=1, api_key=("k",))
    assert engine.num_replicas == 2 and engine.init_args[0].served_model_name == ("a",)


def test_the_kuberay_manifest_builds_the_application_it_describes() -> None:
    """deploy/kuberay/rayservice.yaml as a user applies it: its Serve config's args build the application, for the
    Ray version the image (deploy/Dockerfile) is built on."""
    import yaml

    root = Path(__file__).resolve().parents[2]
    manifest = yaml.safe_load((root / "deploy" / "kuberay" / "rayservice.yaml").read_text())
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    (application,) = serve_config["applications"]
    assert application["import_path"] == "tokenmill.cluster.app:from_args"
    ingress, (engine,) = deployments(from_args(application["args"]))
    assert (ingress.num_replicas, engine.num_replicas, engine.ray_actor_options["num_cpus"]) == (2, 8, 4)
    assert ingress.init_args[0].stream_interval == 4
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__
    assert f"FROM rayproject/ray:{ray.__version__}-" in (root / "deploy" / "Dockerfile").read_text()
    workers = cluster["workerGroupSpecs"][0]
    cores = int(workers["rayStartParams"]["num-cpus"]) * workers["replicas"]
    assert cores == engine.num_replicas * engine.ray_actor_options["num_cpus"]  # every replica has a place
