"""End-to-end tier: one real `tokenmill serve` process on the default model, shared by the session's tests.

Every response any test reads through `httpx` or `httpx2` (the official `openai` client's transport) is checked against
OpenAI's schema as it streams past (tests/e2e/contract.py): each completion body, each SSE chunk and each error body.
A violation fails the request where it happens and, in case a client swallowed it, the test at teardown.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.contract import VIOLATIONS, patch_transports
from tests.e2e.server import Reference, Server, serve


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # float32: the fidelity tests compare with transformers' fp32 reference; the default mode is default_server's
    yield from serve(["--dtype", "float32"], tmp_path_factory.mktemp("server-fp32"))


@pytest.fixture(scope="session")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The mode a user gets from `tokenmill serve`: bfloat16 activations, the GGUF file's own quantised weights
    (test_seeds_under_load.py)."""
    yield from serve([], tmp_path_factory.mktemp("server-default"))


@pytest.fixture(scope="session", autouse=True)
def openapi_contract() -> Iterator[None]:
    """Wraps the network transports of httpx and httpx2 for the whole session."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        for name in ("httpx", "httpx2"):
            try:
                patch_transports(monkeypatch, importlib.import_module(name))
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
@pytest.fixture(scope="session")
def default_weights() -> Any:
    """The default model as the server loads it: float32 weights (HF names), tokenizer, source id."""
    import torch

    from tokenmill.model.loading.loader import load_model_files

    return load_model_files(None, None, torch.float32)


@pytest.fixture(scope="session")
def reference(default_weights: Any) -> Reference:
    """The default model's weights (float32, as the server runs) loaded into `transformers`' own Gemma 3."""
    from tokenmill.bench.hf_reference import transformers_gemma3

    model = transformers_gemma3(default_weights.config, default_weights.state_dict).float()
    return Reference(default_weights, model)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)
