"""End-to-end tier: one real `tokenmill serve` process on the default model, shared by the session's tests.

Every response any test reads through `httpx` or `httpx2` (the official `openai` client's transport) is checked against
OpenAI's schema as it streams past (tests/openapi_contract.py): each completion body, each SSE chunk and each error
body. A violation fails the request where it happens and, in case a client swallowed it, the test at teardown.
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import openai
import pytest

from tests.openapi_contract import ContractViolation, ResponseCheck
from tokenmill.bench.servers import ManagedServer, free_port, tokenmill_spec

MODEL = "gemma-3-270m"
START_TIMEOUT_S = 300  # the very first start converts the GGUF file (~10 s on 2 cores), later ones take ~2 s


@dataclass
class Server:
    base_url: str

    def client(self, **kw: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0, timeout=120, **kw)

    def stats(self) -> dict[str, int]:
        return httpx.get(self.base_url + "/stats", timeout=10).json()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # float32: the fidelity tests compare with transformers' fp32 reference; test_default_mode.py covers the default
    yield from serve(["--dtype", "float32"], tmp_path_factory.mktemp("server-fp32"))


@pytest.fixture(scope="session")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The mode a user gets from `tokenmill serve`: bfloat16 activations, int8 weights."""
    yield from serve([], tmp_path_factory.mktemp("server-default"))


def serve(extra_args: list[str], log_dir: Path) -> Iterator[Server]:
    """The real server on the default model, as the benchmark starts it (a failed start raises with its log's tail)."""
    with ManagedServer(tokenmill_spec(free_port(), None, extra_args), log_dir) as managed:
        managed.start(START_TIMEOUT_S)
        yield Server(managed.url)


# --- the OpenAPI contract on every response -------------------------------------------------------------------------
VIOLATIONS: list[str] = []  # appended from any thread; drained by check_contract after each test
CHECKED = {"bodies": 0}  # bodies read to the end and checked: proof that the wrapping is in place


def _finish(check: ResponseCheck, read_to_end: bool) -> None:
    problems = check.finish(read_to_end)
    CHECKED["bodies"] += check.checked
    _report(problems)


def _report(problems: list[str]) -> None:
    if problems:
        VIOLATIONS.extend(problems)
        raise ContractViolation("\n".join(problems))


def _checked_sync(lib: ModuleType, stream: Any, check: ResponseCheck) -> Any:
    class Checked(lib.SyncByteStream):  # type: ignore[name-defined, misc]
        def __init__(self) -> None:
            self.read_to_end = False

        def __iter__(self) -> Iterator[bytes]:
            for chunk in stream:
                _report(check.feed(chunk))
                yield chunk
            self.read_to_end = True

        def close(self) -> None:
            stream.close()
            _finish(check, self.read_to_end)

    return Checked()


def _checked_async(lib: ModuleType, stream: Any, check: ResponseCheck) -> Any:
    class Checked(lib.AsyncByteStream):  # type: ignore[name-defined, misc]
        def __init__(self) -> None:
            self.read_to_end = False

        async def __aiter__(self) -> AsyncIterator[bytes]:
            async for chunk in stream:
                _report(check.feed(chunk))
                yield chunk
            self.read_to_end = True

        async def aclose(self) -> None:
            await stream.aclose()
            _finish(check, self.read_to_end)

    return Checked()


def _response_check(request: Any, response: Any) -> ResponseCheck:
    content_type = response.headers.get("content-type", "")
    return ResponseCheck(request.method, request.url.path, response.status_code, content_type)


def _patch_transports(monkeypatch: pytest.MonkeyPatch, lib: ModuleType) -> None:
    sync_send, async_send = lib.HTTPTransport.handle_request, lib.AsyncHTTPTransport.handle_async_request

    def handle_request(self: Any, request: Any) -> Any:
        response = sync_send(self, request)
        check = _response_check(request, response)
        if check.active:
            response.stream = _checked_sync(lib, response.stream, check)
        return response

    async def handle_async_request(self: Any, request: Any) -> Any:
        response = await async_send(self, request)
        check = _response_check(request, response)
        if check.active:
            response.stream = _checked_async(lib, response.stream, check)
        return response

    monkeypatch.setattr(lib.HTTPTransport, "handle_request", handle_request)
    monkeypatch.setattr(lib.AsyncHTTPTransport, "handle_async_request", handle_async_request)


@pytest.fixture(scope="session", autouse=True)
def openapi_contract() -> Iterator[None]:
    """Wraps the network transports of httpx and httpx2 for the whole session."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        for name in ("httpx", "httpx2"):
            try:
                _patch_transports(monkeypatch, importlib.import_module(name))
            except ImportError:
                pass
        yield


@pytest.fixture(autouse=True)
def check_contract(openapi_contract: None) -> Iterator[None]:
    VIOLATIONS.clear()
    yield
    found, VIOLATIONS[:] = list(VIOLATIONS), []
    if found:
        pytest.fail("OpenAPI contract violated:\n" + "\n".join(found[:20]), pytrace=False)


# --- the reference: transformers on the same weights ----------------------------------------------------------------
@dataclass
class Reference:
    weights: Any  # tokenmill.model.loading.loader.LoadedWeights, float32
    model: Any  # transformers' Gemma3ForCausalLM on those weights, float32, eval mode


@pytest.fixture(scope="session")
def default_weights() -> Any:
    """The default model as the server loads it: float32 weights (HF names), tokenizer, source id."""
    import torch

    from tokenmill.model.loading.loader import load_model_files

    return load_model_files(None, None, torch.float32)


@pytest.fixture(scope="session")
def reference(default_weights: Any) -> Reference:
    """The default model's weights (float32, as the server runs) loaded into `transformers`' own Gemma 3."""
    from tests.model.test_gemma3_vs_hf import hf_gemma3

    return Reference(default_weights, hf_gemma3(default_weights.config, default_weights.state_dict))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)
