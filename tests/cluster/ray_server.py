"""`tokenmill serve --replicas N` as a real process tree (Ray, Serve's proxy, the replicas), for the `ray` tier.

Ray probes outward addresses to find its own, so these tests run only inside a private network namespace where
loopback is the one interface (`make test` runs the tier under `unshare -n`); elsewhere they skip, saying so.
The server is stopped with SIGTERM (which stops Serve and the Ray instance it started), and its whole process
group killed if that does not end it.
"""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.api.scrape import Samples
from tests.api.server_process import Server, serve_process, wait_ready

START_TIMEOUT_S = 240  # Ray, Serve, the proxy and every replica loading its model, on two busy cores
STOP_TIMEOUT_S = 90


def in_private_network() -> bool:
    """Loopback is the only interface: nothing Ray binds or probes can leave this machine."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def skip_unless_private_network() -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        not in_private_network(),
        reason="Ray runs only in a private network namespace: `make test` runs this tier under unshare -n",
    )


def every_replica_up(health: httpx.Response) -> bool:
    return health.status_code == 200 and health.json()["status"] == "ok"


@contextmanager
def serve_replicas(model_dir: Path, tmp_path: Path, *flags: str) -> Iterator[Server]:
    flags = ("--model", str(model_dir), "--cache-dir", str(tmp_path), *flags)
    with serve_process(
        flags,
        tmp_path / f"ray-server-{time.monotonic_ns()}.log",
        start_timeout_s=START_TIMEOUT_S,
        ready=every_replica_up,
        stop_signal=signal.SIGTERM,
        grace_s=STOP_TIMEOUT_S,
        env={"RAY_USAGE_STATS_ENABLED": "0"},
    ) as server:
        yield server


def wait_healthy(server: Server, timeout_s: float = START_TIMEOUT_S, headers: dict[str, str] | None = None) -> None:
    """Until /health says ok with every replica up (a start, or a recovery after a replica died)."""
    wait_ready(server, timeout_s, every_replica_up, headers)


def per_replica(samples: Samples, name: str) -> dict[str, float]:
    """A per-replica series of a parsed scrape as {replica id: value}."""
    return {dict(labels)["replica"]: value for (sample, labels), value in samples.items() if sample == name}
