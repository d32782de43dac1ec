"""OpenAI's published schema as a test oracle for every completion body, stream chunk and error body.

The schemas come from `tests/spec/openai-openapi-completions.yaml`, a verbatim copy of the completions excerpt of the
official OpenAPI document. Where the hosted API itself departs from that document, so do we, and only there:
- with `echo`, the first prompt token has no logprob: `null` in `token_logprobs` and `top_logprobs` (the one documented
  deviation of the response body);
- a stream chunk carries `finish_reason: null` until its choice ends, and with `include_usage` every chunk but the last
  carries `usage: null` (the document says streamed and non-streamed objects share one shape; the hosted API and the
  official SDKs' chunk types have these nulls).
Error bodies must be OpenAI's full shape: `{"error": {"message", "type", "param", "code"}}`, all four keys present.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator

SPEC = Path(__file__).parent / "spec" / "openai-openapi-completions.yaml"
COMPLETIONS_PATH = "/v1/completions"


class ContractViolation(AssertionError):
    pass


@cache
def spec_schemas() -> dict[str, Any]:
    """Every named schema of the excerpt (it keeps the schemas' own indentation, not the document's nesting)."""
    doc = yaml.safe_load(SPEC.read_text())
    return {name: schema for section in doc.values() for name, schema in section.items() if name[:1].isupper()}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _validator(root: str, schemas: dict[str, Any]) -> Draft202012Validator:
    return Draft202012Validator({"$ref": f"#/components/schemas/{root}", "components": {"schemas": schemas}})


@cache
def completion_validator(stream: bool) -> Draft202012Validator:
    schemas = copy.deepcopy(spec_schemas())
    response = schemas["CreateCompletionResponse"]
    choice = response["properties"]["choices"]["items"]["properties"]
    logprobs = choice["logprobs"]["anyOf"][0]["properties"]
    for key in ("token_logprobs", "top_logprobs"):  # the echo deviation
        logprobs[key]["items"] = _nullable(logprobs[key]["items"])
    if stream:
        choice["finish_reason"] = _nullable(choice["finish_reason"])
        response["properties"]["usage"] = _nullable(response["properties"]["usage"])
    return _validator("CreateCompletionResponse", schemas)


@cache
def error_validator() -> Draft202012Validator:
    schemas = copy.deepcopy(spec_schemas())
    schemas["Error"]["required"] = ["message", "type", "param", "code"]
    return _validator("ErrorResponse", schemas)


def schema_problems(validator: Draft202012Validator, body: Any, what: str) -> list[str]:
    return [
        f"{what}: {error.message} at {'/'.join(map(str, error.absolute_path)) or '(root)'} in {json.dumps(body)[:400]}"
        for error in validator.iter_errors(body)
    ]


def completion_problems(body: Any, stream: bool = False) -> list[str]:
    return schema_problems(completion_validator(stream), body, "stream chunk" if stream else "completion")


def error_problems(body: Any) -> list[str]:
    return schema_problems(error_validator(), body, "error body")


class ResponseCheck:
    """Checks one HTTP response's body as it streams past: fed bytes, it returns the problems found so far.

    Which bodies: every /v1/completions response (JSON or SSE) and every error response (status >= 400) of any path.
    """

    def __init__(self, method: str, path: str, status: int, content_type: str) -> None:
        self.kind = _kind(method, path, status, content_type)
        self.buffer = b""
        self.saw_done = False
        self.checked = False  # the whole body was seen and checked

    @property
    def active(self) -> bool:
        return self.kind is not None

    def feed(self, data: bytes) -> list[str]:
        self.buffer += data
        if self.kind != "sse":
            return []
        problems: list[str] = []
        while b"\n\n" in self.buffer:
            frame, self.buffer = self.buffer.split(b"\n\n", 1)
            problems += self._frame(frame.decode("utf-8"))
        return problems

    def finish(self, read_to_end: bool) -> list[str]:
        """The body is closed; `read_to_end` says whether the reader saw all of it (else only frames so far count).
        A client may stop reading at `[DONE]` (the openai SDKs do): that is the end of the stream too."""
        if not (read_to_end or self.saw_done):
            return []
        self.checked = True
        if self.kind == "sse":
            if self.buffer.strip():
                return [f"stream ended inside a frame: {self.buffer[:200]!r}"]
            return [] if self.saw_done else ["stream ended without `data: [DONE]`"]
        try:
            body = json.loads(self.buffer)
        except ValueError:
            return [f"{self.kind} body is not JSON: {self.buffer[:200]!r}"]
        return completion_problems(body) if self.kind == "completion" else error_problems(body)

    def _frame(self, frame: str) -> list[str]:
        lines = [line for line in frame.split("\n") if line and not line.startswith(":")]
        if not lines:
            return []  # a comment (keep-alive) frame
        if len(lines) != 1 or not lines[0].startswith("data: "):
            return [f"malformed SSE frame {frame[:200]!r}"]
        if self.saw_done:
            return [f"frame after [DONE]: {frame[:200]!r}"]
        data = lines[0][len("data: ") :]
        if data == "[DONE]":
            self.saw_done = True
            return []
        try:
            payload = json.loads(data)
        except ValueError:
            return [f"SSE frame is not JSON: {data[:200]!r}"]
        if isinstance(payload, dict) and "error" in payload:
            return error_problems(payload)
        return completion_problems(payload, stream=True)


def _kind(method: str, path: str, status: int, content_type: str) -> str | None:
    if method == "HEAD":
        return None
    if status >= 400:
        return "error"
    if path == COMPLETIONS_PATH and status == 200:
        return "sse" if content_type.startswith("text/event-stream") else "completion"
    return None
