"""Server-sent events by hand: `data: {json}\\n\\n` frames, `data: [DONE]`, and an abort when the client goes away.

`SSEResponse` listens for `http.disconnect` while it streams (whatever ASGI version the server speaks) and always closes
its body iterator, so the engine requests behind it are aborted and their KV blocks freed.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenmill.api.errors import APIError

DONE = "data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def dumps(obj: Any) -> str:
    # allow_nan=False: a stray NaN/inf is a bug to surface, not invalid JSON to send.
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def data(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


def error_frame(error: APIError) -> str:
    return data(error.body())


class SSEResponse(StreamingResponse):
    def __init__(self, frames: AsyncIterator[str], on_close: Callable[[], Awaitable[None]] | None = None) -> None:
        super().__init__(frames, media_type="text/event-stream", headers=HEADERS)
        self._frames = frames
        self._on_close = on_close  # runs once the stream is over, however it ended

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream_then_stop() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away mid-send
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            try:
                aclose = getattr(self._frames, "aclose", None)
                if aclose is not None:
                    with anyio.CancelScope(shield=True):
                        await aclose()
            finally:
                if self._on_close is not None:
                    with anyio.CancelScope(shield=True):  # settles what the request was charged, even on shutdown
                        await self._on_close()
