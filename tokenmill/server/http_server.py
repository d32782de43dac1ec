"""Run the app under uvicorn, and shut down gently on SIGTERM.

On SIGTERM the listener stays open but new completions (and /health) answer 503 with `Retry-After`, so a load balancer
moves traffic elsewhere; completions already admitted run on for up to `shutdown_grace_s`. Then the engine stops, so
whatever still runs ends with a 503 (an error frame then `[DONE]` when streaming), uvicorn stops, and the process exits
0. A second SIGTERM stops at once; SIGINT (Ctrl-C) behaves as `uvicorn app:app`'s does: it shuts down and exits 0.

Logging is the process's (api/logs.py, set up by the command line): uvicorn gets no configuration of its own, so its
lines come out in the same format, and its access log is off, replaced by ours (api/access_log.py). Once the server
listens, the start-up banner says where and what it serves.

A request's line and headers are bounded (--max-header-bytes): httptools, uvicorn's parser here, has no bound of its
own and joins a long header's pieces as they arrive, in time that grows with the square of its length. Past the
bound the connection gets a 431 with OpenAI's error body and is closed (h11, where it is used, answers 400).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import signal
import socket
from collections.abc import Awaitable, Callable
from types import FrameType

import prometheus_client
import uvicorn
from fastapi import FastAPI

from tokenmill.api import errors
from tokenmill.api.admission import Admission
from tokenmill.api.app import stop_engines
from tokenmill.config import Config
from tokenmill.engine import guided
from tokenmill.server.banner import log_banner, url_of
from tokenmill.server.freeze import freeze_loaded_objects

log = logging.getLogger(__name__)

CANCEL_AFTER_GRACE_S = 1  # after the grace period, how long uvicorn waits before cancelling what still runs


class DrainingServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        admission: Admission,
        grace_s: float,
        stop_engine: Callable[[], Awaitable[None]],
        on_listening: Callable[[str], None] = lambda url: None,
    ) -> None:
        super().__init__(config)
        self.admission = admission
        self.grace_s = grace_s
        self.stop_engine = stop_engine
        self.on_listening = on_listening  # told the server's URL once it listens
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            port = self.config.port or self.servers[0].sockets[0].getsockname()[1]  # port 0: the one it was given
            self.on_listening(url_of(self.config.host, port))

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or not self.started or self._loop is None:
            super().handle_exit(sig, frame)
        elif self.admission.draining:
            self.should_exit = True  # a second SIGTERM: stop now (and still exit 0: the signal is not re-raised)
        else:
            self.admission.begin_drain()
            self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        log.info(
            "SIGTERM: refusing new requests; %d in flight get %.0f s to finish", self.admission.in_flight, self.grace_s
        )
        if not await self.admission.wait_idle(self.grace_s):
            log.warning("grace period over: ending %d request(s) still in flight", self.admission.in_flight)
            await self.stop_engine()
        self.should_exit = True


def serve(app: FastAPI, config: Config) -> int:
    admission: Admission = app.state.admission
    # every counter's *_created twin doubles a scrape for a start time the process metrics already give;
    # process-wide, so it is switched off here for the server, not in create_app
    prometheus_client.disable_created_metrics()
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=CANCEL_AFTER_GRACE_S,
        http=http_protocol(config.max_header_bytes),
        h11_max_incomplete_event_size=config.max_header_bytes,
    )
    if config.structured_outputs_at_start:
        prepare_structured_outputs(app)

    def banner(url: str) -> None:
        log_banner(url, app.state.engines.values(), with_key=bool(config.api_key))

    freeze_loaded_objects()  # the models are loaded and the app built: what is alive now stays
    try:
        DrainingServer(uv_config, admission, config.shutdown_grace_s, lambda: stop_engines(app), banner).run()
    except KeyboardInterrupt:  # uvicorn re-raises a SIGINT once it has shut down; `uvicorn.run` swallows it too
        pass
    return 0


def prepare_structured_outputs(app: FastAPI) -> None:
    """llguidance's view of each model's vocabulary, built now: its build holds the interpreter for seconds, which on
    the first structured-output request would hold every other request too."""
    for name, engine in app.state.engines.items():
        try:
            guided.ll_tokenizer(engine.tokenizer)
        except guided.GuideError as exc:
            log.warning("%s cannot serve structured outputs: %s", name, exc)


def http_protocol(max_header_bytes: int) -> type[asyncio.Protocol] | str:
    """uvicorn's httptools protocol with the bound on a request's head; h11 (bounded by uvicorn's own setting) where
    httptools is not installed."""
    if importlib.util.find_spec("httptools") is None:
        return "h11"
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class BoundedHead(HttpToolsProtocol):
        """A head that completes is measured exactly (its URL and headers); one still arriving is counted by the reads
        that hold nothing else, and refused before the next read is parsed, so at most one read past the bound is
        ever joined. Refused: a 431, the rest of the message ignored, the connection closed."""

        _in_head = False
        _head_bytes = 0
        _refused = False

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head, self._head_bytes = True, 0

        def on_headers_complete(self) -> None:
            self._in_head = False
            size = len(self.url) + sum(len(name) + len(value) for name, value in self.headers)
            if self._refused or size > max_header_bytes:
                self._refused = True  # answered once the parser returns; no request cycle is started
                return
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self._refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if not self._refused:
                super().on_message_complete()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._in_head and self._head_bytes > max_header_bytes:
                self._refused = True
            else:
                super().data_received(data)
                if self._in_head:  # the head goes on past this read: all of it was head
                    self._head_bytes += len(data)
            if self._refused:
                log.warning("a request's line and headers passed %d bytes: 431, connection closed", max_header_bytes)
                self.transport.write(head_too_large(max_header_bytes))
                self.transport.close()

    return BoundedHead


def head_too_large(max_header_bytes: int) -> bytes:
    """The whole 431 response, with OpenAI's error body."""
    error = errors.APIError(
        431,
        f"The request's headers are too large: more than {max_header_bytes} bytes; this server accepts at most "
        f"{max_header_bytes} bytes.",
        code="request_header_fields_too_large",
    )
    body = json.dumps(error.body()).encode()
    head = (
        "HTTP/1.1 431 Request Header Fields Too Large\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body
