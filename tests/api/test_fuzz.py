"""schemathesis against the app's own OpenAPI document, over ASGI, on the real AsyncEngine around the tiny random model.

For /v1/completions, /tokenize, /detokenize and /v1/models: schema-valid and schema-violating requests alike never get a
5xx (nor FastAPI's 422), every 4xx has OpenAI's error shape, and every completion (JSON or SSE) matches OpenAI's schema.
The CI budget is TOKENMILL_FUZZ_EXAMPLES (default 50) examples per operation and mode; docs/testing.md has the longer run.
"""

from __future__ import annotations

import os
from typing import Any

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.transport import DEFAULT_MAX_STREAM_EVENTS, STREAM_CUT_SHORT_ATTRIBUTE

from tests.engine.tiny import tiny_core
from tests.openapi_contract import ResponseCheck, error_problems
from tokenmill.api.app import create_app
from tokenmill.config import Config
from tokenmill.engine.engine import AsyncEngine

MODEL = "tiny"
MAX_EXAMPLES = int(os.environ.get("TOKENMILL_FUZZ_EXAMPLES", "50"))
MAX_TOKENS = 8  # generation length is not what is being fuzzed; this keeps one example in milliseconds
CALL_TIMEOUT_S = 120  # a hang still fails; a slow first step on a busy 2-core machine does not
OPERATIONS = r"^/(v1/completions|tokenize|detokenize|v1/models.*)$"


class FreshEngineApp:
    """The app around a new tiny engine for every lifespan: schemathesis ends the app's lifespan after each test and
    starts it again for the next, and an AsyncEngine, like a server process, runs once."""

    def __init__(self) -> None:
        self.app = self._build()

    @staticmethod
    def _build() -> Any:
        return create_app(AsyncEngine(tiny_core(), MODEL, "fp_tiny"), Config())

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            self.app = self._build()
        await self.app(scope, receive, send)


def fuzz_schema() -> Any:
    """The app's OpenAPI document read from the app object itself: loading it over ASGI (`from_asgi`) would start an
    engine at import time whose lifespan shutdown is not guaranteed, and its thread would then hold the interpreter
    open at exit (collection alone hung that way whenever pytest's warning filters were configured)."""
    app = FreshEngineApp()
    loaded = schemathesis.openapi.from_dict(app.app.openapi())
    loaded.app = app  # every case is called over ASGI against a fresh engine per lifespan, as from_asgi would
    schema = loaded.include(path_regex=OPERATIONS)
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], max_examples=MAX_EXAMPLES)
    return schema


schema = fuzz_schema()


def _tame(body: Any) -> None:
    """Point requests at the served model (else nearly all are 404s), stream when stream_options are sent (else
    nearly all are 400s), and keep generations short."""
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = MODEL
    if isinstance(body.get("stream_options"), dict) and body.get("stream") is not True:
        body["stream"] = True
    tokens = body.get("max_tokens")
    if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > MAX_TOKENS:
        body["max_tokens"] = tokens % (MAX_TOKENS + 1)


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors_and_openai_shaped_errors(case: Any) -> None:
    _tame(case.body)
    response = case.call(timeout=CALL_TIMEOUT_S)
    case.validate_response(response, checks=[not_a_server_error])
    assert response.status_code != 422, response.text  # bad values are 400s naming the param, never FastAPI's 422
    if response.status_code >= 400:
        assert error_problems(response.json()) == []
    elif case.path == "/v1/completions":
        check = ResponseCheck("POST", case.path, response.status_code, response.headers.get("content-type", [""])[0])
        # schemathesis stops reading an event stream at a deadline (it marks that) or after DEFAULT_MAX_STREAM_EVENTS
        # events (it does not); frames end in a blank line, which JSON inside a frame can never contain
        frames = response.content.count(b"\n\n")
        read_to_end = not getattr(response, STREAM_CUT_SHORT_ATTRIBUTE, False) and frames < DEFAULT_MAX_STREAM_EVENTS
        assert check.feed(response.content) + check.finish(read_to_end) == []
