"""Server management on stand-in processes (Python's http.server), not on real model servers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tokenmill.bench.servers import (
    ManagedServer,
    RssSampler,
    ServerSpec,
    ServerStartError,
    free_port,
    peer_spec,
    tokenmill_spec,
)


def http_server_spec(port: int) -> ServerSpec:
    argv = (sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1")
    return ServerSpec("stand-in", argv, port, "/")


def test_a_server_is_started_watched_and_stopped(tmp_path: Path) -> None:
    server = ManagedServer(http_server_spec(free_port()), tmp_path)
    with server:
        assert server.start(timeout_s=60) > 0
        process = server._process
        assert process is not None and process.poll() is None
    assert process.poll() is not None  # stopped on leaving the block
    assert server.peak_rss_mb is not None and server.peak_rss_mb > 0


def test_a_server_that_exits_fails_with_its_log(tmp_path: Path) -> None:
    argv = (sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)")
    server = ManagedServer(ServerSpec("broken", argv, free_port(), "/health"), tmp_path)
    with pytest.raises(ServerStartError, match="exited with 3(.|\n)*no model here"):
        server.start(timeout_s=60)


def test_a_server_that_never_gets_ready_is_stopped(tmp_path: Path) -> None:
    argv = (sys.executable, "-c", "import time; time.sleep(60)")
    server = ManagedServer(ServerSpec("silent", argv, free_port(), "/health"), tmp_path)
    with pytest.raises(ServerStartError, match="not ready in time"):
        server.start(timeout_s=0.3)
    assert server._process is None


def test_the_rss_sampler_sees_this_process() -> None:
    import os

    sampler = RssSampler(os.getpid(), interval_s=0.01)
    assert sampler.sample() > 0


def test_the_rss_sampler_counts_children_and_looks_them_up_only_now_and_then(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import subprocess
    import sys

    import psutil

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lookups: list[int] = []
        children = psutil.Process.children
        monkeypatch.setattr(psutil.Process, "children", lambda self, **kw: lookups.append(1) or children(self, **kw))
        sampler = RssSampler(os.getpid(), children_every_s=60.0)
        mine = psutil.Process(os.getpid()).memory_info().rss
        assert sampler.sample() > mine  # the child's memory counts
        sampler.sample()
        sampler.sample()
        assert len(lookups) == 1  # one lookup for three samples
    finally:
        child.kill()
        child.wait()


def test_server_commands_listen_on_loopback_only() -> None:
    ours = tokenmill_spec(8001, "/m.gguf", ["--dtype", "bfloat16"], cache_dir="/tmp/c")
    assert ours.argv[1:4] == ("-m", "tokenmill.cli", "serve")
    assert ours.argv[ours.argv.index("--host") + 1] == "127.0.0.1" and ours.url == "http://127.0.0.1:8001"
    assert ours.argv[-2:] == ("--dtype", "bfloat16") and "--cache-dir" in ours.argv
    peer = peer_spec("/venv/bin/python", 8002, "/m.gguf", threads=2, n_ctx=4096, extra=[])
    assert peer.argv[:3] == ("/venv/bin/python", "-m", "llama_cpp.server")
    assert peer.argv[peer.argv.index("--host") + 1] == "127.0.0.1"
    assert peer.argv[peer.argv.index("--n_threads") + 1] == "2" and peer.ready_path == "/v1/models"
    assert peer.argv[peer.argv.index("--model_alias") + 1] == "m"  # the file's stem, as tokenmill names the model


def test_the_peer_is_rebuilt_when_its_cmake_arguments_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An existing venv built before AMX was left out (its server segfaults on such CPUs) is rebuilt, once."""
    import subprocess

    from tokenmill.bench import servers

    python = tmp_path / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    runs: list[tuple[list[str], str]] = []

    def fake_run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[bytes]:
        env = kwargs.get("env")
        runs.append((command, env["CMAKE_ARGS"] if isinstance(env, dict) else ""))
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(servers, "_imports", lambda python, module: True)
    monkeypatch.setattr(servers.subprocess, "run", fake_run)
    monkeypatch.setattr("tokenmill.bench.native_flags.platform.machine", lambda: "x86_64")
    assert servers.ensure_peer_venv(tmp_path, version="9.9.9") == str(python)
    [(command, cmake_args)] = runs
    assert command[-1] == "llama-cpp-python[server]==9.9.9" and "--force-reinstall" in command
    assert "-mno-amx-tile" in cmake_args and "-DGGML_NATIVE=ON" in cmake_args
    servers.ensure_peer_venv(tmp_path, version="9.9.9")
    assert len(runs) == 1  # built alike: nothing to do
