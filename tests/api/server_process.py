"""A real `tokenmill serve` process on 127.0.0.1, for the tests that need the whole server: every tier starts its
servers here (the fast tier on the tiny model, the e2e tier on the default model, the `ray` tier with replicas).

Its stdout and stderr go to a log file the tests read. It runs in a session of its own and is always stopped: sent the
tier's signal, then, if it has not ended within the grace, killed with everything it spawned.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tokenmill.bench.servers import free_port

START_TIMEOUT_S = 120


@dataclass
class Server:
    base_url: str
    process: subprocess.Popen[bytes]
    log: Path

    def wait_exit(self, timeout_s: float = 60) -> int:
        return self.process.wait(timeout=timeout_s)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


class ServerNotReadyError(RuntimeError):
    """The server exited, or did not answer ready, within its bound; the message ends with its log's tail."""


def answers_200(response: httpx.Response) -> bool:
    return response.status_code == 200


@contextmanager
def serve(model_dir: Path, tmp_path: Path, *flags: str) -> Iterator[Server]:
    """The server on `model_dir` with `tmp_path` as its cache dir, killed at the end (the tests wait for what they
    need before they leave)."""
    flags = ("--model", str(model_dir), "--cache-dir", str(tmp_path), *flags)
    with serve_process(flags, tmp_path / f"server-{time.monotonic_ns()}.log") as server:
        yield server


@contextmanager
def serve_process(
    flags: Sequence[str],
    log: Path,
    *,
    start_timeout_s: float = START_TIMEOUT_S,
    ready: Callable[[httpx.Response], bool] = answers_200,
    stop_signal: signal.Signals = signal.SIGKILL,
    grace_s: float = 30,
    env: Mapping[str, str] | None = None,
) -> Iterator[Server]:
    """`tokenmill serve --host 127.0.0.1 --port <free> *flags`, yielded once GET /health passes `ready`."""
    port = free_port()
    command = [sys.executable, "-m", "tokenmill.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]
    with log.open("wb") as out:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
        )
    server = Server(f"http://127.0.0.1:{port}", process, log)
    try:
        wait_ready(server, start_timeout_s, ready)
        yield server
    finally:
        stop(process, stop_signal, grace_s)


def wait_ready(
    server: Server,
    timeout_s: float = START_TIMEOUT_S,
    ready: Callable[[httpx.Response], bool] = answers_200,
    headers: dict[str, str] | None = None,
) -> None:
    """Until GET /health passes `ready` (a start, or a recovery), bounded by `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise ServerNotReadyError(f"the server exited with {server.process.returncode}:\n{server.log_tail()}")
        try:
            if ready(httpx.get(server.base_url + "/health", timeout=5, headers=headers)):
                return
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.2)
    raise ServerNotReadyError(f"the server was not ready within {timeout_s:.0f} s:\n{server.log_tail()}")


def stop(process: subprocess.Popen[bytes], stop_signal: signal.Signals, grace_s: float) -> None:
    if process.poll() is None:
        process.send_signal(stop_signal)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # its own session: whatever it spawned and left behind
    except ProcessLookupError:
        pass
    process.wait(timeout=30)
