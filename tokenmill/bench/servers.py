"""Start, watch and stop the servers under test: tokenmill, and llama-cpp-python's server from its own venv.

Each server is a child process in its own session, with its output in a log file; a thread samples the resident
memory of the process and its children for the peak RSS figure.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from tokenmill.bench.native_flags import peer_cmake_args

PEER_PACKAGE = "llama-cpp-python[server]=={version}"
PEER_VERSION = "0.3.36"


def peer_alias(model: str) -> str:
    """The name a peer serves its model under: the file's stem, as tokenmill names a GGUF file's model."""
    return Path(model).stem


class ServerStartError(RuntimeError):
    """The server exited or did not become ready in time; the message ends with its log's tail."""


@dataclass(frozen=True)
class ServerSpec:
    name: str
    argv: tuple[str, ...]
    port: int
    ready_path: str  # a GET that answers 200 once the model is loaded
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def tokenmill_spec(port: int, model: str | None, extra: list[str], cache_dir: str | None = None) -> ServerSpec:
    argv = [
        sys.executable,
        "-m",
        "tokenmill.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    argv += ["--model", model] if model else []
    argv += ["--cache-dir", cache_dir] if cache_dir else []
    return ServerSpec("tokenmill", (*argv, *extra), port, "/health")


def peer_spec(python: str, port: int, model: str, threads: int, n_ctx: int, extra: list[str]) -> ServerSpec:
    argv = [
        python,
        "-m",
        "llama_cpp.server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_threads",
        str(threads),
        "--n_threads_batch",
        str(threads),
        "--n_ctx",
        str(n_ctx),
        "--model_alias",
        peer_alias(model),
        "--interrupt_requests",
        "False",
    ]  # its default cuts a running stream short when another request arrives
    return ServerSpec("llama-cpp-python", (*argv, *extra), port, "/v1/models")


PEER_STAMP = "tokenmill-cmake-args.txt"  # the CMAKE_ARGS the venv's llama-cpp-python was built with


def ensure_peer_venv(venv: Path, version: str = PEER_VERSION, timeout_s: float = 3600) -> str:
    """The peer's python, creating the venv and building llama-cpp-python (~9 min on 2 cores) if it is missing or
    was built with other CMake arguments. On x86-64 they leave AMX out, as for llama-server (native_flags.py): this
    llama.cpp's AMX matmul faults on CPUs that report AMX (the server segfaults on its first completion)."""
    python = venv / "bin" / "python"
    stamp, cmake_args = venv / PEER_STAMP, peer_cmake_args()
    built_alike = stamp.is_file() and stamp.read_text() == cmake_args
    if python.exists() and built_alike and _imports(str(python), "llama_cpp.server"):
        return str(python)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    log = venv / "build.log"
    print(
        f"building {PEER_PACKAGE.format(version=version)} into {venv} (compiles llama.cpp: minutes); log: {log}",
        flush=True,
    )
    # rebuilt from source whatever is installed or cached, so the wheel is the one these arguments make
    pip = [str(python), "-m", "pip", "install", "--force-reinstall", "--no-cache-dir"]
    with log.open("ab") as out:
        subprocess.run(
            [*pip, PEER_PACKAGE.format(version=version)],
            stdout=out,
            stderr=subprocess.STDOUT,
            check=True,
            timeout=timeout_s,
            env={**os.environ, "CMAKE_ARGS": cmake_args},
        )
    stamp.write_text(cmake_args)
    return str(python)


def _imports(python: str, module: str) -> bool:
    probe = subprocess.run([python, "-c", f"import {module}"], check=False, capture_output=True, timeout=120)
    return probe.returncode == 0


class RssSampler:
    """Peak resident memory of a process and all its children, sampled every `interval_s` on a thread.

    The children are looked up every `children_every_s` only: psutil finds them by reading every process's /proc
    entry (about a millisecond here), while one process's RSS is one small read. Sampled ten times a second for two
    servers, the lookups took 2% of a core from the machine under measurement, beside the load generator."""

    def __init__(self, pid: int, interval_s: float = 0.1, children_every_s: float = 2.0) -> None:
        import psutil  # the bench extra

        self._process = psutil.Process(pid)
        self._interval = interval_s
        self._children_every = children_every_s
        self._processes: list[psutil.Process] = [self._process]
        self._looked_up = -float("inf")  # when the children were last looked up
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rss-{pid}", daemon=True)
        self.peak_bytes = 0

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def sample(self) -> int:
        import psutil

        total = 0
        if time.monotonic() - self._looked_up >= self._children_every:
            try:
                self._processes = [self._process, *self._process.children(recursive=True)]
            except psutil.Error:
                return 0
            self._looked_up = time.monotonic()
        for process in self._processes:
            try:
                total += process.memory_info().rss
            except psutil.Error:
                pass  # a child that just exited
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, self.sample())
            self._stop.wait(self._interval)


class ManagedServer:
    """One server process: `start()` returns the seconds from spawn to ready; `stop()` ends it (and its session)."""

    def __init__(self, spec: ServerSpec, log_dir: Path) -> None:
        self.spec = spec
        self.log_path = log_dir / f"{spec.name}-{spec.port}.log"
        self._process: subprocess.Popen[bytes] | None = None
        self._rss: RssSampler | None = None

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def peak_rss_mb(self) -> float | None:
        return self._rss.peak_bytes / 2**20 if self._rss else None

    def start(self, timeout_s: float) -> float:
        start = time.perf_counter()
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                self.spec.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.spec.env},
                start_new_session=True,
            )
        self._rss = RssSampler(self._process.pid).start()
        self._wait_ready(start + timeout_s)
        return time.perf_counter() - start

    def _wait_ready(self, deadline: float) -> None:
        import httpx

        assert self._process is not None
        with httpx.Client(trust_env=False, timeout=5.0) as client:
            while time.perf_counter() < deadline:
                if self._process.poll() is not None:
                    raise ServerStartError(
                        f"{self.spec.name} exited with {self._process.returncode}\n{self.log_tail()}"
                    )
                try:
                    if client.get(self.url + self.spec.ready_path).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass  # not listening yet
                time.sleep(0.05)
        self.stop()
        raise ServerStartError(f"{self.spec.name} was not ready in time\n{self.log_tail()}")

    def stop(self, grace_s: float = 15.0) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)  # its own session: the server and anything it spawned
                process.wait(timeout=grace_s)
        if self._rss is not None:
            self._rss.stop()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
