"""A real `tokenmill serve` process on the tiny model (127.0.0.1 only): overload, SIGTERM drain, grace expiry; and
what serve() does before uvicorn runs.

Every loop here is bounded in count and in time; the process is always stopped (killed if it will not stop).
"""

from __future__ import annotations

import asyncio
import gc
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from tests.api.api_helpers import parse_sse
from tests.api.fake_engine import FakeEngine
from tests.api.server_process import Server, serve
from tokenmill.api.app import create_app
from tokenmill.bench.servers import free_port
from tokenmill.config import Config
from tokenmill.server import http_server

NO_EOS = {"1": -100}  # the tiny tokenizer's <eos>: these requests run to max_tokens


def long_request(model: str, **fields: Any) -> dict[str, Any]:
    return {"model": model, "prompt": "hello", "max_tokens": 150, "logit_bias": NO_EOS, **fields}


async def _until(client: httpx.AsyncClient, path: str, done: Any, timeout_s: float = 30) -> Any:
    """Poll GET `path` until `done(response)` holds (bounded)."""
    for _ in range(int(timeout_s / 0.01)):
        response = await client.get(path)
        if done(response):
            return response
        await asyncio.sleep(0.01)
    raise TimeoutError(path)


def test_at_four_times_the_queue_cap_every_request_is_200_or_429_and_health_answers(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    flags = ("--max-num-seqs", "2", "--max-waiting-requests", "4", "--log-level", "warning")
    with serve(tiny_model_dir, tmp_path, *flags) as server:
        statuses, health = asyncio.run(asyncio.wait_for(_overload(server, tiny_model_dir.name), 120))
        stats = httpx.get(server.base_url + "/stats", timeout=10).json()
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) > 0 and statuses.count(200) >= 4
    assert health and set(health) == {200}
    assert stats["num_used_blocks"] == 0 and stats["num_running"] == 0


async def _overload(server: Server, model: str) -> tuple[list[int], list[int]]:
    """16 concurrent requests (4 × the waiting cap), then 16 more, while /health is polled throughout."""
    statuses: list[int] = []
    health: list[int] = []
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:

        async def one(i: int) -> None:
            response = await client.post("/v1/completions", json=long_request(model, n=2, stream=i % 2 == 0))
            if response.status_code == 429:
                assert response.headers["retry-after"] == "1"
                assert response.json()["error"]["code"] == "rate_limit_exceeded"
            elif response.status_code == 200 and i % 2 == 0:
                assert parse_sse(response.text)[-1] == "[DONE]"
            statuses.append(response.status_code)

        async def poll_health(stop: asyncio.Event) -> None:
            while not stop.is_set():
                health.append((await client.get("/health")).status_code)
                await asyncio.sleep(0.05)

        stop = asyncio.Event()
        poller = asyncio.create_task(poll_health(stop))
        for _ in range(2):
            await asyncio.gather(*(one(i) for i in range(16)))
        stop.set()
        await poller
    return statuses, health


async def _sigterm_during_requests(
    client: httpx.AsyncClient, server: Server, model: str
) -> list[asyncio.Task[httpx.Response]]:
    """Four long requests (the first streamed) sent, once one runs and the engine holds all four SIGTERM: returns the
    requests' tasks. (Waiting for the first to run alone raced the other three's admission: a request the server
    had not yet taken when the signal came was refused, 503, as it should be, and the test saw it fail.)"""
    in_flight = [
        asyncio.create_task(client.post("/v1/completions", json=long_request(model, stream=i == 0))) for i in range(4)
    ]

    def all_held(r: httpx.Response) -> bool:
        stats = r.json()
        return stats["num_running"] > 0 and stats["num_running"] + stats["num_waiting"] == 4

    await _until(client, "/stats", all_held)
    server.process.send_signal(signal.SIGTERM)
    return in_flight


def test_sigterm_refuses_new_requests_finishes_in_flight_ones_and_exits_0(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = tiny_model_dir.name
    with serve(tiny_model_dir, tmp_path, "--max-num-seqs", "1", "--shutdown-grace-s", "60") as server:

        async def scenario() -> tuple[list[httpx.Response], httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
                in_flight = await _sigterm_during_requests(client, server, model)
                health = await _until(client, "/health", lambda r: r.status_code == 503)
                refused = await client.post("/v1/completions", json=long_request(model))
                return list(await asyncio.gather(*in_flight)), health, refused

        finished, health, refused = asyncio.run(asyncio.wait_for(scenario(), 120))
        code = server.wait_exit()
    assert code == 0
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "service_unavailable" and health.headers["retry-after"] == "1"
    assert [r.status_code for r in finished] == [200] * 4
    assert parse_sse(finished[0].text)[-1] == "[DONE]"
    assert all(r.json()["usage"]["completion_tokens"] == 150 for r in finished[1:])
    assert "in flight get 60 s to finish" in server.log.read_text()


def test_past_the_grace_period_what_still_runs_ends_with_503_and_the_process_exits_0(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model = tiny_model_dir.name
    with serve(tiny_model_dir, tmp_path, "--max-num-seqs", "1", "--shutdown-grace-s", "0.1") as server:

        async def scenario() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
                in_flight = await _sigterm_during_requests(client, server, model)
                return list(await asyncio.gather(*in_flight))

        responses = asyncio.run(asyncio.wait_for(scenario(), 120))
        code = server.wait_exit()
    assert code == 0
    streamed = parse_sse(responses[0].text)
    assert responses[0].status_code == 200 and streamed[-1] == "[DONE]"
    plain = [r.status_code for r in responses[1:]]
    assert set(plain) <= {200, 503} and 503 in plain
    assert all(r.json()["error"]["code"] == "service_unavailable" for r in responses[1:] if r.status_code == 503)
    assert "grace period over" in server.log.read_text()


def test_ctrl_c_stops_the_server_with_exit_0_and_no_traceback(tiny_model_dir: Path, tmp_path: Path) -> None:
    """SIGINT (Ctrl-C in a terminal) stops the server as `uvicorn app:app` does: shut down, exit 0, no traceback.
    Why a test: uvicorn re-raises the signal once it has stopped, which `uvicorn.run` swallows and a bare
    `Server.run()` does not."""
    with serve(tiny_model_dir, tmp_path, "--log-level", "info") as server:
        server.process.send_signal(signal.SIGINT)
        code = server.wait_exit()
    log = server.log.read_text()
    assert code == 0, log
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
    assert "Application shutdown complete" in log  # it stopped the way it stops, not killed


def test_serve_freezes_what_loading_left_before_the_server_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    frozen_when_run: list[int] = []
    monkeypatch.setattr(http_server.DrainingServer, "run", lambda self: frozen_when_run.append(gc.get_freeze_count()))
    monkeypatch.setattr(http_server.prometheus_client, "disable_created_metrics", lambda: None)  # process-wide
    try:
        assert http_server.serve(create_app(FakeEngine(), Config()), Config()) == 0
        assert frozen_when_run and frozen_when_run[0] > 0
    finally:
        gc.unfreeze()


# --- the request's head is bounded ----------------------------------------------------------------------------------
@contextmanager
def bounded_server(max_header_bytes: int) -> Iterator[int]:
    """The app on a fake engine under uvicorn with serve()'s protocol, on a thread; yields its port."""
    port = free_port()
    config = uvicorn.Config(
        create_app(FakeEngine(), Config()),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        http=http_server.http_protocol(max_header_bytes),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(1000):  # up to 10 s
            if server.started or not thread.is_alive():
                break
            time.sleep(0.01)
        assert server.started
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def send_raw(port: int, pieces: list[bytes]) -> bytes:
    """Send `pieces` one by one (as separate reads, where the server is quick), then read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            for piece in pieces:
                sock.sendall(piece)
                time.sleep(0.005)
        except OSError:
            pass  # the server may close before the last piece: its answer is already on the way
        answer = b""
        while chunk := sock.recv(1 << 16):
            answer += chunk
    return answer


START = b"GET /health HTTP/1.1\r\nHost: test\r\n"


@pytest.mark.parametrize(
    "pieces",
    [
        [START + b"X-Big: " + b"a" * 5000 + b"\r\nConnection: close\r\n\r\n"],  # whole, in one read
        [START + b"X-Big: "] + [b"a" * 500] * 200,  # arriving piece by piece, never finished
        [START] + [b"X-%d: v\r\n" % i for i in range(300)],  # many small headers
    ],
    ids=["one-read", "never-ending", "many-headers"],
)
def test_a_head_over_the_bound_is_a_431_and_the_server_goes_on(pieces: list[bytes]) -> None:
    with bounded_server(1024) as port:
        answer = send_raw(port, pieces)
        head, _, content = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 431 "), answer[:200]
        error = json.loads(content)["error"]
        assert error["code"] == "request_header_fields_too_large" and "1024 bytes" in error["message"]
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200


def test_a_head_within_the_bound_is_served() -> None:
    with bounded_server(1024) as port:
        answer = send_raw(port, [START + b"X-Ok: " + b"a" * 800 + b"\r\nConnection: close\r\n\r\n"])
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]


def test_structured_outputs_at_start_builds_each_grammar_tokenizer_before_serving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[Any] = []
    monkeypatch.setattr(http_server.guided, "ll_tokenizer", built.append)
    monkeypatch.setattr(http_server.DrainingServer, "run", lambda self: None)
    monkeypatch.setattr(http_server.prometheus_client, "disable_created_metrics", lambda: None)  # process-wide
    engine = FakeEngine()
    try:
        assert http_server.serve(create_app(engine, Config()), Config(structured_outputs_at_start=True)) == 0
    finally:
        gc.unfreeze()
    assert built == [engine.tokenizer]
