"""End-to-end tier: one real `tokenmill serve` process on the default model, shared by the session's tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest

MODEL = "gemma-3-270m"
START_TIMEOUT_S = 300  # the very first start converts the GGUF file (~30 s on 2 cores), later ones take seconds


@dataclass
class Server:
    base_url: str
    process: subprocess.Popen[bytes]

    def client(self, **kw: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0, timeout=120, **kw)

    def stats(self) -> dict[str, int]:
        return httpx.get(self.base_url + "/stats", timeout=10).json()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(base_url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("server did not become healthy")


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    port = free_port()
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning"]
    process = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, process)
        yield Server(base_url, process)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)
