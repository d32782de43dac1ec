"""A real `tokenmill serve` process on a model directory (127.0.0.1 only), for the tests that need the whole server.

The process is always stopped (killed if it will not stop); its stdout and stderr go to a log file the tests read.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

START_TIMEOUT_S = 120


@dataclass
class Server:
    base_url: str
    process: subprocess.Popen[bytes]
    log: Path

    def wait_exit(self, timeout_s: float = 60) -> int:
        return self.process.wait(timeout=timeout_s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve(model_dir: Path, tmp_path: Path, *flags: str) -> Iterator[Server]:
    port, log = free_port(), tmp_path / f"server-{time.monotonic_ns()}.log"
    cmd = [
        sys.executable,
        "-m",
        "tokenmill.cli",
        "serve",
        "--model",
        str(model_dir),
        "--cache-dir",
        str(tmp_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *flags,
    ]
    with log.open("wb") as out:
        process = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    server = Server(f"http://127.0.0.1:{port}", process, log)
    try:
        _wait_healthy(server)
        yield server
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)


def _wait_healthy(server: Server) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert server.process.poll() is None, server.log.read_text()
        try:
            if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the server did not become healthy")
