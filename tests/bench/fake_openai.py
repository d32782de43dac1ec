"""A tiny fake OpenAI-compatible completions server as an httpx transport: one text chunk per token.

Like tokenmill by default (usage in the stream, /tokenizer_info); `peer_like=True` behaves like llama-cpp-python's
server instead (no usage, no /tokenizer_info). A request that does not ban EOS_ID stops early with "stop".
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

EOS_ID = 7
EARLY_STOP_AT = 3  # tokens generated before "EOS" when it is not banned


@dataclass
class FakeOpenAI:
    peer_like: bool = False
    fail_every: int = 0  # answer every n-th completion with a 500 (0: never)
    step_s: float = 0.001
    weight_bytes: int | None = None  # tokenmill-like: /stats reports the weights one decode step reads
    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        if request.method == "GET" and request.url.path == "/tokenizer_info" and not self.peer_like:
            return httpx.Response(200, json={"eos_token_id": EOS_ID, "bos_token_id": 1})
        if request.method == "GET" and request.url.path == "/stats" and self.weight_bytes is not None:
            return httpx.Response(200, json={"steps": 0, "weight_bytes_per_token": self.weight_bytes})
        if request.method == "POST" and request.url.path == "/v1/completions":
            body = json.loads(request.content)
            self.bodies.append(body)
            if self.fail_every and len(self.bodies) % self.fail_every == 0:
                return httpx.Response(500, json={"error": {"message": "boom"}})
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=self._stream(body))
        return httpx.Response(404, json={"error": {"message": "not found"}})

    async def _stream(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        banned = str(EOS_ID) in (body.get("logit_bias") or {})
        tokens = body["max_tokens"] if banned else min(EARLY_STOP_AT, body["max_tokens"])
        for i in range(tokens):
            await asyncio.sleep(self.step_s)
            finish = None if i < tokens - 1 else ("length" if banned else "stop")
            yield _event({"choices": [{"index": 0, "text": f" t{i}", "finish_reason": finish}], "usage": None})
        if not self.peer_like:
            usage = {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens}
            yield _event({"choices": [], "usage": usage})
        self.in_flight -= 1  # before [DONE]: the client stops reading there
        yield b"data: [DONE]\n\n"


def _event(chunk: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(chunk)}\n\n".encode()
