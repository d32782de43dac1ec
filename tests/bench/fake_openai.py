"""A tiny fake OpenAI-compatible completions server on 127.0.0.1: one text chunk per token.

Like tokenmill by default (usage in the stream, /tokenizer_info; a non-streamed request's prompt tokens are its words); `peer_like=True` behaves like llama-cpp-python's
server instead (no usage, no /tokenizer_info). A request that does not ban EOS_ID stops early with "stop".
`with FakeOpenAI().running() as url:` serves it from a thread of its own, on an event loop of its own, so that the
code under test can run its own loop (`tokenmill bench` calls asyncio.run itself).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

EOS_ID = 7
EARLY_STOP_AT = 3  # tokens generated before "EOS" when it is not banned


@dataclass
class FakeOpenAI:
    peer_like: bool = False
    fail_every: int = 0  # answer every n-th completion with a 500 (0: never)
    step_s: float = 0.001
    weight_bytes: int | None = None  # tokenmill-like: /stats reports the weights one decode step reads
    close_after_stream: bool = False  # as llama-server does: the connection closed after a stream, keep-alive or not
    context: int | None = None  # a prompt of more words than this is refused with a 400, as a full context is
    cut_to: int | None = None  # a prompt of more words is read as its last cut_to (ik_llama.cpp keeps the end)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    @contextmanager
    def running(self) -> Iterator[str]:
        """Serve on a free loopback port until the block ends; yields the base URL."""
        loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self.handle)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        port = runner.addresses[0][1]
        thread = threading.Thread(target=loop.run_forever, name="fake-openai", daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            loop.close()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.method == "GET" and request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        if request.method == "GET" and request.path == "/tokenizer_info" and not self.peer_like:
            return web.json_response({"eos_token_id": EOS_ID, "bos_token_id": 1})
        if request.method == "GET" and request.path == "/stats" and self.weight_bytes is not None:
            return web.json_response({"steps": 0, "weight_bytes_per_token": self.weight_bytes})
        if request.method == "POST" and request.path == "/v1/completions":
            body = await request.json()
            self.bodies.append(body)
            if self.fail_every and len(self.bodies) % self.fail_every == 0:
                return web.json_response({"error": {"message": "boom"}}, status=500)
            return await self._stream(request, body) if body.get("stream") else self._answer(body)
        return web.json_response({"error": {"message": "not found"}}, status=404)

    def _answer(self, body: dict[str, Any]) -> web.Response:
        """A non-streamed completion of max_tokens tokens; a prompt's tokens are its words."""
        words = len(str(body["prompt"]).split())
        if self.context is not None and words > self.context:
            return web.json_response({"error": {"message": f"{words} tokens exceed the context"}}, status=400)
        read = words if self.cut_to is None else min(words, self.cut_to)
        usage = {"prompt_tokens": read, "completion_tokens": body["max_tokens"]}
        text = " t" * body["max_tokens"]
        return web.json_response({"choices": [{"index": 0, "text": text, "finish_reason": "length"}], "usage": usage})

    async def _stream(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        banned = str(EOS_ID) in (body.get("logit_bias") or {})
        tokens = body["max_tokens"] if banned else min(EARLY_STOP_AT, body["max_tokens"])
        try:
            for i in range(tokens):
                await asyncio.sleep(self.step_s)
                finish = None if i < tokens - 1 else ("length" if banned else "stop")
                chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": finish}], "usage": None}
                await response.write(_event(chunk))
            if not self.peer_like:
                usage = {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens}
                await response.write(_event({"choices": [], "usage": usage}))
        except ConnectionResetError:
            return response  # the client went away (a test of its timeout)
        finally:
            self.in_flight -= 1  # before [DONE]: the client stops reading there
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        if self.close_after_stream and request.transport is not None:
            request.transport.close()
        return response


def _event(chunk: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(chunk)}\n\n".encode()
