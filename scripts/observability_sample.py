"""What a scrape of /metrics and the server's log look like after a few real requests, for docs/operations.md.

python scripts/observability_sample.py [--default-model] [--log-format text|json] [--out DIR]

Starts `tokenmill serve` (127.0.0.1, a free port, an API key) on a tiny random-weight Gemma 3 written to a temporary
directory (tests/tiny_model.py, so run it from the repository root), or with `--default-model` on the packaged
Gemma 3 270M, sends a plain completion with a `user`, a streamed
one of the same prompt (its full blocks come from the prefix cache) and a request for a path that does not exist,
scrapes /metrics, stops the server with SIGTERM, then prints the server's log and the scrape's `tokenmill_` lines
(`--out` also writes both whole). The tiny model's text is noise.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tokenmill.bench.servers import free_port

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-sample"
START_TIMEOUT_S = 120


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-format", choices=("text", "json"), default="text")
    parser.add_argument("--out", type=Path, help="also write server.log and metrics.txt here")
    parser.add_argument("--default-model", action="store_true", help="serve the packaged Gemma 3 270M instead")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from tests.tiny_model import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = None if args.default_model else write_tiny_model(Path(tmp) / "tiny-gemma3")
        log, scrape = run_server(model, Path(tmp), args.log_format)
    print(log, end="")
    print()
    print("\n".join(line for line in scrape.splitlines() if "tokenmill_" in line))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "server.log").write_text(log)
        (args.out / "metrics.txt").write_text(scrape)
    return 0


def run_server(model: Path | None, tmp: Path, log_format: str) -> tuple[str, str]:
    """Serve (model None: the packaged default), send the requests, scrape, stop: (the server's log, the scrape)."""
    port, log_path = free_port(), tmp / "server.log"
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--cache-dir", str(tmp)]
    cmd += ["--model", str(model), "--kv-cache-mb", "4"] if model is not None else []
    cmd += ["--port", str(port), "--api-key", KEY, "--log-format", log_format]
    with log_path.open("wb") as out:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, process)
        scrape = send_requests(base, model.name if model is not None else "gemma-3-270m")
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    return log_path.read_text(), scrape


def send_requests(base: str, model: str) -> str:
    auth = {"Authorization": f"Bearer {KEY}"}
    prompt = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"  # sent twice:
    with httpx.Client(base_url=base, headers=auth, timeout=60) as client:  # the second reads its blocks from the cache
        plain = {"model": model, "prompt": prompt, "max_tokens": 8, "user": "alice"}
        client.post("/v1/completions", json=plain, headers={"x-request-id": "readme-1"}).raise_for_status()
        streamed = {"model": model, "prompt": prompt, "max_tokens": 8, "stream": True}
        client.post("/v1/completions", json=streamed).raise_for_status()
        client.get("/v1/nothing-here")
        scrape = client.get("/metrics")
        scrape.raise_for_status()
        return scrape.text


def wait_healthy(base: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError("the server exited before it was healthy")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the server did not become healthy")


if __name__ == "__main__":
    sys.exit(main())
