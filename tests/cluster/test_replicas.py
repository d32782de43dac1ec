"""Two engine replicas on Ray Serve (`tokenmill serve --replicas 2`) on the tiny model, over real HTTP through Serve's
proxy: the API as one process serves it, prefix-affinity routing, metrics over every replica, and a replica killed
under load. The `ray` tier: `make test` runs it in a private network namespace (tests/cluster/ray_server.py)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.api.scrape import parse, value
from tests.api.server_process import Server, serve
from tests.cluster.ray_server import per_replica, serve_replicas, skip_unless_private_network, wait_healthy
from tests.tiny_model import write_tiny_model

pytestmark = [pytest.mark.ray, skip_unless_private_network()]

KEY = "k-ray-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny"
TIMEOUT_S = 60
SHARED = "the capital of France is Paris and the world is hello " * 3  # 30+ tokens: two whole KV blocks
LONG_CONTEXT = 1280
LONG_STREAM = 1200  # tokens: ~10x what a stream generates between its first chunk and the kill (scraping takes ~1 s)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with room for streams long enough to be still running when a replica is killed under them."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-long"), max_position_embeddings=LONG_CONTEXT)


@pytest.fixture(scope="module")
def replicas(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("ray")
    with serve_replicas(model_dir, tmp, "--replicas", "2", "--api-key", KEY, "--served-model-name", MODEL) as server:
        yield server


@pytest.fixture(scope="module")
def one_process(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    flags = ("--api-key", KEY, "--served-model-name", MODEL, "--threads", "1")
    with serve(model_dir, tmp_path_factory.mktemp("single"), *flags) as server:
        yield server


def post(server: Server, body: dict[str, Any], headers: dict[str, str] | None = AUTH) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/completions", json=body, headers=headers, timeout=TIMEOUT_S)


def frames(server: Server, body: dict[str, Any]) -> Iterator[Any]:
    """A streamed completion's frames as they arrive: each JSON payload, then the string "[DONE]"."""
    with httpx.stream(
        "POST", server.base_url + "/v1/completions", json={**body, "stream": True}, headers=AUTH, timeout=TIMEOUT_S
    ) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                payload = line.removeprefix("data: ")
                yield payload if payload == "[DONE]" else json.loads(payload)


def stream(server: Server, body: dict[str, Any]) -> list[Any]:
    return list(frames(server, body))


def comparable(response: httpx.Response) -> dict[str, Any]:
    """The body without what differs on every call (its id and time)."""
    body: dict[str, Any] = response.json()
    body.pop("id", None)
    body.pop("created", None)
    return body


CASES = [
    {"prompt": SHARED + "def", "max_tokens": 12, "temperature": 0},
    {"prompt": "hello world", "max_tokens": 8, "temperature": 0.8, "seed": 7, "n": 2},
    {"prompt": SHARED, "max_tokens": 0, "echo": True, "logprobs": 3},
    {"prompt": ["the capital of", "hello world and the"], "max_tokens": 6, "temperature": 0, "logprobs": 2},
    {"prompt": SHARED, "max_tokens": 10, "temperature": 1.0, "seed": 3, "best_of": 3, "stop": ["s"]},
]


@pytest.mark.parametrize("case", CASES)
def test_a_completion_is_what_one_process_answers(case: dict[str, Any], replicas: Server, one_process: Server) -> None:
    body = {"model": MODEL, **case}
    ours, reference = post(replicas, body), post(one_process, body)
    assert ours.status_code == reference.status_code == 200, ours.text
    assert comparable(ours) == comparable(reference)


def test_a_stream_joins_to_the_completion(replicas: Server) -> None:
    body = {"model": MODEL, "prompt": SHARED + "hello", "max_tokens": 16, "temperature": 0}
    frames = stream(replicas, {**body, "stream_options": {"include_usage": True}})
    assert frames[-1] == "[DONE]"
    text = "".join(c["text"] for frame in frames[:-1] for c in frame["choices"])
    assert text == post(replicas, body).json()["choices"][0]["text"]
    assert frames[-2]["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize(
    ("body", "headers", "status", "param"),
    [
        ({"model": MODEL, "prompt": "hi", "max_tokens": -1}, AUTH, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "no_such_field": 1}, AUTH, 400, "no_such_field"),
        ({"model": "nope", "prompt": "hi"}, AUTH, 404, "model"),
        ({"model": MODEL, "prompt": "hi"}, None, 401, None),
        ({"model": MODEL, "prompt": "hi"}, {"Authorization": "Bearer wrong"}, 401, None),
    ],
)
def test_errors_are_the_same_openai_errors(
    body: dict[str, Any], headers: dict[str, str] | None, status: int, param: str | None, replicas: Server
) -> None:
    response = post(replicas, body, headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param


def test_the_official_client_works_through_the_proxy(replicas: Server) -> None:
    client = openai.OpenAI(base_url=replicas.base_url + "/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT_S)
    done = client.completions.create(model=MODEL, prompt="hello world", max_tokens=5, temperature=0)
    assert done.choices[0].finish_reason == "length" and done.usage is not None and done.usage.completion_tokens == 5
    pieces = client.completions.create(model=MODEL, prompt="hello world", max_tokens=5, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in pieces if chunk.choices) == done.choices[0].text


def scrape(server: Server) -> Any:
    response = httpx.get(server.base_url + "/metrics", headers=AUTH, timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    return parse(response.text)


def test_prompts_sharing_a_prefix_meet_one_replica_and_its_cache(replicas: Server) -> None:
    prefix = "and the world is hello France of the capital " * 3  # unlike any other test's first block
    before = per_replica(scrape(replicas), "tokenmill_replica_tokens_computed_total")
    usages = [
        post(replicas, {"model": MODEL, "prompt": prefix + tail, "max_tokens": 2, "temperature": 0}).json()["usage"]
        for tail in ("def", "return", "is", "to the", "in", "of Paris")
    ]
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert all(u["prompt_tokens_details"]["cached_tokens"] >= 16 for u in usages[1:]), usages
    after = per_replica(scrape(replicas), "tokenmill_replica_tokens_computed_total")
    grew = [replica for replica in after if after[replica] > before.get(replica, 0)]
    assert len(after) == 2 and len(grew) == 1, (before, after)  # the other replica did no work for them


def test_different_prefixes_spread_over_both_replicas(replicas: Server) -> None:
    before = per_replica(scrape(replicas), "tokenmill_replica_tokens_computed_total")
    for i in range(16):  # a different first block each: 2 x 2^-16 that the ring puts them all on one replica
        prompt = f"{i} {i * 7} {i * 13} " + SHARED
        assert post(replicas, {"model": MODEL, "prompt": prompt, "max_tokens": 1}).status_code == 200
    after = per_replica(scrape(replicas), "tokenmill_replica_tokens_computed_total")
    assert all(after[replica] > before.get(replica, 0) for replica in after), (before, after)


def test_metrics_and_stats_cover_every_replica(replicas: Server) -> None:
    post(replicas, {"model": MODEL, "prompt": "hello world " * 10, "max_tokens": 4})
    samples = scrape(replicas)
    stats = httpx.get(replicas.base_url + "/stats", headers=AUTH, timeout=TIMEOUT_S).json()
    tokens = per_replica(samples, "tokenmill_replica_tokens_computed_total")
    assert len(tokens) == 2 and sum(tokens.values()) == stats["tokens_computed"] > 0
    assert value(samples, "tokenmill_engine_step_seconds_count", model=MODEL) == stats["steps"]
    assert value(samples, "tokenmill_replicas", model=MODEL) == 2
    assert value(samples, "tokenmill_http_requests_total", route="/v1/completions", status="200") > 0
    health = httpx.get(replicas.base_url + "/health", timeout=TIMEOUT_S).json()
    assert health == {"status": "ok", "models": {MODEL: {"replicas": 2, "target_replicas": 2}}}


def test_killing_a_replica_under_load_loses_nothing_that_had_not_started(replicas: Server) -> None:
    """Streams on the dead replica end with an error frame and [DONE]; everything else, and every non-streamed
    request (which has sent nothing yet), succeeds; then Ray restarts the replica. Runs last: it kills one."""
    results: dict[str, Any] = {}
    started = threading.Barrier(9, timeout=TIMEOUT_S)

    def streamed(i: int) -> None:
        prompt = f"{i} hello {i} world " * 5
        body = {"model": MODEL, "prompt": prompt, "max_tokens": LONG_STREAM, "temperature": 0, "ignore_eos": True}
        seen: list[Any] = []
        for frame in frames(replicas, body):
            seen.append(frame)
            if len(seen) == 1:
                started.wait()
        results[f"stream-{i}"] = seen

    def whole(i: int) -> None:
        body = {"model": MODEL, "prompt": f"{i} of the {i} capital " * 5, "max_tokens": 120, "temperature": 0}
        results[f"whole-{i}"] = post(replicas, body)

    threads = [threading.Thread(target=streamed, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    started.wait()  # every stream has its first chunk: they are all mid-generation
    victim = _busiest_replica_pid(scrape(replicas))
    os.kill(victim, signal.SIGKILL)
    threads += [threading.Thread(target=whole, args=(i,)) for i in range(6)]  # sent as the replica dies
    for thread in threads[8:]:
        thread.start()
    deadline = time.monotonic() + 2 * TIMEOUT_S
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    assert len(results) == 14, f"requests still hanging: {sorted(results)}"

    cut = 0
    for name, result in results.items():
        if name.startswith("whole"):
            assert result.status_code == 200, result.text
            continue
        assert result[-1] == "[DONE]", name
        errors = [frame["error"] for frame in result[:-1] if "error" in frame]
        if errors:
            cut += 1
            assert errors[0]["code"] == "service_unavailable", errors
        else:
            assert result[-2]["choices"][0]["finish_reason"] == "length", name
    assert cut >= 1, "the killed replica was running streams, so some stream must have been cut"

    wait_healthy(replicas, timeout_s=120)
    assert post(replicas, {"model": MODEL, "prompt": SHARED, "max_tokens": 3}).status_code == 200


def _busiest_replica_pid(samples: Any) -> int:
    running = per_replica(samples, "tokenmill_replica_running_sequences")
    busiest = max(running, key=lambda replica: running[replica])
    assert running[busiest] > 0, running
    pids = [dict(labels)["pid"] for (name, labels) in samples if name == "tokenmill_replica_info"]
    replicas = [dict(labels)["replica"] for (name, labels) in samples if name == "tokenmill_replica_info"]
    return int(pids[replicas.index(busiest)])


def test_a_conversations_next_round_goes_where_its_history_is_cached(replicas: Server) -> None:
    """Users whose prompts share only a system prompt's first block: the ring puts them all on one replica until its
    load bound spills some to the other. Each replica then reports the blocks it holds, and a user's next round goes
    to the replica holding its history, not back to the ring's choice (where only the system prompt is cached)."""
    system = "hello world the capital is of France and " * 4  # more than two whole blocks, unlike other tests'
    histories = [system + f"user {i} " + "Paris is the capital of France and the world " * 4 for i in range(12)]
    before = per_replica(scrape(replicas), "tokenmill_replica_tokens_computed_total")
    first: dict[int, dict[str, Any]] = {}

    def ask(i: int) -> None:
        body = {"model": MODEL, "prompt": histories[i], "max_tokens": 300, "temperature": 0, "ignore_eos": True}
        first[i] = post(replicas, body).json()["usage"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(histories))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    after = per_replica(scrape(replicas), "tokenmill_replica_tokens_computed_total")
    assert all(after[r] > before.get(r, 0) for r in after), (before, after)  # the bound spilled some users over
    time.sleep(3.0)  # each replica reports its blocks every second
    for i, history in enumerate(histories):
        usage = post(replicas, {"model": MODEL, "prompt": history + " and then", "max_tokens": 1}).json()["usage"]
        held = (first[i]["prompt_tokens"] - 1) // 16 * 16
        assert usage["prompt_tokens_details"]["cached_tokens"] >= held - 16, (i, first[i], usage)
