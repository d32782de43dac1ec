"""Stand-ins for Ray Serve's deployment handle and response streams, so RemoteEngine runs without a Ray cluster."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

from ray.exceptions import ActorDiedError
from ray.serve import context as serve_context

from tokenmill.engine.outputs import RequestOutput, SequenceDelta

DIED = object()  # in a script: the replica dies here


def output(request_id: str, text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id, [SequenceDelta(0, text, [1], None)], [5, 6], finished=finished)


class FakeStream:
    """What `handle.options(stream=True).generate.remote(...)` returns: outputs, or the replica dying mid-way."""

    def __init__(self, script: Iterable[Any]) -> None:
        self.script = list(script)
        self.cancelled = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._run()

    async def _run(self) -> AsyncIterator[RequestOutput]:
        for item in self.script:
            if item is DIED:
                raise ActorDiedError()
            yield item

    def cancel(self) -> None:
        self.cancelled = True


class FakeBroadcast:
    def __init__(self, handle: FakeHandle) -> None:
        self.handle = handle

    async def results_async(self, timeout_s: float | None = None, return_exceptions: bool = False) -> list[Any]:
        self.handle.broadcasts += 1
        return list(self.handle.snapshots)


class FakeHandle:
    """A deployment handle whose generate calls play `scripts` in turn; each call's internal request id is kept."""

    def __init__(self, scripts: Iterable[Iterable[Any]] = (), snapshots: Iterable[Any] = ()) -> None:
        self.scripts = [FakeStream(s) for s in scripts]
        self.streams: list[FakeStream] = []
        self.snapshots = list(snapshots)
        self.broadcasts = 0
        self.internal_ids: list[str] = []
        self.generate = self

    def options(self, **options: Any) -> FakeHandle:
        return self

    def remote(self, *args: Any) -> FakeStream:
        self.internal_ids.append(serve_context._get_serve_request_context()._internal_request_id)
        stream = self.scripts[len(self.streams)]
        self.streams.append(stream)
        return stream

    def broadcast(self, method: str) -> FakeBroadcast:
        assert method == "snapshot"
        return FakeBroadcast(self)
