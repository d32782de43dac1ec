"""`tokenmill serve --ray-address` joining a Ray cluster started beforehand, as on a cluster's head node (the `ray`
tier, in a private network namespace). Its own module: `ray stop` ends every Ray process of the namespace."""

from __future__ import annotations

import secrets
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.cluster.ray_server import serve_replicas, skip_unless_private_network
from tokenmill.bench.servers import free_port

pytestmark = [pytest.mark.ray, skip_unless_private_network()]

MODEL = "tiny"


def test_serve_joins_a_ray_cluster_that_is_already_running(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ray start --head` first (as on a cluster's head node), then `tokenmill serve --ray-address` onto it."""
    # both sides with Ray's token auth, as docs/scaling.md says; the token in a file of the test's own (a new machine
    # has no ~/.ray/auth_token, and `ray start` then refuses to start)
    token = tmp_path / "ray_auth_token"
    token.write_text(secrets.token_hex(32))
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    port = free_port()
    ray_cli = str(Path(sys.executable).with_name("ray"))
    head = [ray_cli, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2"]
    head += ["--include-dashboard=false", "--disable-usage-stats"]
    started = subprocess.run(head, check=False, timeout=120, capture_output=True, text=True)
    assert started.returncode == 0, f"ray start failed:\n{started.stderr[-3000:]}"
    try:
        flags = ("--ray-address", f"127.0.0.1:{port}", "--replicas", "1", "--served-model-name", MODEL)
        with serve_replicas(tiny_model_dir, tmp_path, *flags) as server:
            response = httpx.post(
                server.base_url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=60
            )
            assert response.status_code == 200, response.text
            assert httpx.get(server.base_url + "/health", timeout=60).json()["models"][MODEL]["replicas"] == 1
    finally:
        subprocess.run([ray_cli, "stop", "--force"], check=False, timeout=120, capture_output=True)
