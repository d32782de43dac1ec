"""`tokenmill serve --replicas N` as a real process tree (Ray, Serve's proxy, the replicas), for the `ray` tier.

Ray probes outward addresses to find its own, so these tests run only inside a private network namespace where
loopback is the one interface (`make test` runs the tier under `unshare -n`); elsewhere they skip, saying so.
The server is stopped with SIGTERM (which stops Serve and the Ray instance it started), and its whole process
group killed if that does not end it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.api.scrape import Samples
from tests.api.server_process import Server, free_port

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


@contextmanager
def serve_replicas(model_dir: Path, tmp_path: Path, *flags: str) -> Iterator[Server]:
    port, log = free_port(), tmp_path / f"ray-server-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--model", str(model_dir), "--cache-dir", str(tmp_path)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), *flags]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    with log.open("wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", process, log)
    try:
        wait_healthy(server)
        yield server
    finally:
        _stop(process)


def wait_healthy(server: Server, timeout_s: float = START_TIMEOUT_S, headers: dict[str, str] | None = None) -> None:
    """Until /health says ok with every replica up (a start, or a recovery after a replica died)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.process.poll() is None, server.log.read_text()
        try:
            health = httpx.get(server.base_url + "/health", timeout=5, headers=headers)
            if health.status_code == 200 and health.json()["status"] == "ok":
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the replicas did not all become healthy:\n{server.log.read_text()[-4000:]}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # whatever of Ray's is left in the server's session
    except ProcessLookupError:
        pass
    process.wait(timeout=30)


def per_replica(samples: Samples, name: str) -> dict[str, float]:
    """A per-replica series of a parsed scrape as {replica id: value}."""
    return {dict(labels)["replica"]: value for (sample, labels), value in samples.items() if sample == name}
