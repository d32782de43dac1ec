"""AsyncEngine: the asyncio face of the engine, with the step loop running in one worker thread.

Requests and aborts arriving from the event loop are queued in an inbox that the worker drains at the start of every
step, so a request that arrives while others run joins the very next step (continuous batching), and an abort frees
its blocks within one step. `generate` queues a request at once, before its outputs are read (Outputs): the HTTP edge
hands each request over as it is admitted, so a burst's first requests start while the rest are still being parsed.
Only the worker thread touches EngineCore. If the loop itself ends (stopped, or a bug), every waiting caller gets a
final error output instead of waiting forever, and `is_healthy()` turns false.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from tokenmill.engine.core import EngineCore, EngineStats
from tokenmill.engine.outputs import (
    AdapterInfo,
    AdapterLoadError,
    EngineDescription,
    RequestOutput,
    StepReport,
    chunk_complete,
    merged,
)
from tokenmill.engine.sampling import SamplingParams
from tokenmill.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_Add = tuple[str, list[int], SamplingParams]
T = TypeVar("T")
ENGINE_STOPPED = "the engine is not running"


def engine_thread() -> ThreadPoolExecutor:
    """The thread an engine's step loop runs on (and its model is loaded on, server/load.py)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-engine")


class Outputs:
    """One request's outputs (AsyncEngine.generate), an async iterator that ends after the finished one. Closing it
    before then (aclose or close, or dropping it: a stream whose client left before it started reading) aborts the
    request, as does a cancellation while it waits for the next output."""

    def __init__(
        self, queue: asyncio.Queue[RequestOutput], request_id: str, engine: AsyncEngine | None, chunk_tokens: int = 1
    ) -> None:
        self._queue = queue
        self._request_id = request_id
        self._engine = engine  # None: nothing to abort (the engine had stopped)
        self._done = False  # the finished output was read, or it was closed
        self._chunk_tokens = chunk_tokens  # --stream-interval: after the first output, each carries this many tokens
        self._first = True

    @classmethod
    def ended(cls, output: RequestOutput) -> Outputs:
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        queue.put_nowait(output)
        return cls(queue, output.request_id, None)

    def __aiter__(self) -> Outputs:
        return self

    async def __anext__(self) -> RequestOutput:
        """The next output; with --stream-interval N, after the first, the next outputs joined until they carry N
        tokens of a sequence (the end and an error at once)."""
        if self._done:
            raise StopAsyncIteration
        out = await self._next()
        if self._chunk_tokens > 1:
            while not (self._first or chunk_complete(out, self._chunk_tokens)):
                out = merged(out, await self._next())
        self._first = False
        return out

    async def _next(self) -> RequestOutput:
        try:
            out = await self._queue.get()
        except BaseException:  # cancelled while waiting: nobody will read the rest
            self.close()
            raise
        if out.finished:
            self._done = True
            if self._engine is not None:
                self._engine._queues.pop(self._request_id, None)
        return out

    def close(self) -> None:
        if self._done:
            return
        self._done = True
        if self._engine is not None:
            self._engine._abort(self._request_id)

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class AsyncEngine:
    def __init__(
        self,
        core: EngineCore,
        model_name: str,
        system_fingerprint: str,
        executor: ThreadPoolExecutor | None = None,
        description: EngineDescription | None = None,
        stream_interval: int = 1,
    ) -> None:
        self.core = core
        self.stream_interval = stream_interval  # tokens a request's outputs carry each, after its first
        self.description = description  # dtype, quantisation, KV capacity, kernels: for the start-up banner
        self.tokenizer: Tokenizer = core.tokenizer
        self.model_name = model_name
        self.system_fingerprint = system_fingerprint
        self.max_model_len = core.max_model_len
        self._lock = threading.Lock()
        self._adds: list[_Add] = []
        self._calls: list[tuple[Callable[[], Any], Future[Any]]] = []  # run on the engine thread between steps
        self._loop_ended = False  # the step loop has returned (set with its last drain of _calls)
        self._aborts: list[str] = []
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._wakeup = threading.Event()
        self._stopping = False
        self._closed = False  # the core closed (stop)
        self._ended = False  # set on the event loop once the step loop has ended and its waiters were failed
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Future[None] | None = None
        self._executor = executor or engine_thread()

    def run_in_engine_thread(self, fn: Callable[[], T]) -> T:
        """Run fn on the engine's thread and wait (in-process tools; never while the step loop is running)."""
        return self._executor.submit(fn).result()

    # ---- lifecycle ----
    async def start(self) -> None:
        """Starts the step loop on the engine's thread; it runs steps back to back while there is work."""
        self._event_loop = asyncio.get_running_loop()
        self._task = asyncio.wrap_future(self._executor.submit(self._run))

    async def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        if not self._closed:  # the engine's thread owns the core: its last call closes it
            self._closed = True
            await asyncio.wrap_future(self._executor.submit(self.core.close))
        self._executor.shutdown(wait=True)

    def is_healthy(self) -> bool:
        return self._task is not None and not self._task.done() and not self._ended

    def health(self) -> None:
        """No replicas to count: one engine in this process (cluster/'s RemoteEngine counts its replicas)."""

    async def refresh(self) -> None:
        """Nothing to fetch: the engine's state is in this process."""

    def stats(self) -> EngineStats:
        with self._lock:
            return self.core.snapshot_stats()

    def add_step_observer(self, observe: Callable[[StepReport], None]) -> None:
        """`observe` is called on the engine thread after every step that ran a batch (keep it short and
        thread-safe); add observers before `start`."""
        self.core.step_observers.append(observe)

    # ---- LoRA adapters ----
    def adapters(self) -> list[AdapterInfo]:
        return [
            AdapterInfo(a.name, a.path, adapter_fingerprint(self.system_fingerprint, a.digest))
            for a in self.core.loaded_adapters()
        ]

    async def load_adapter(self, name: str, path: str) -> None:
        """Loads the adapter at `path` under `name`, between two steps (AdapterError: why it cannot be served)."""
        try:
            await self.between_steps(lambda: self.core.load_adapter(name, path))
        except Exception as exc:
            log.warning("adapter %r from %s not loaded: %s", name, path, exc)
            raise AdapterLoadError(str(exc) or type(exc).__name__) from exc

    async def unload_adapter(self, name: str) -> None:
        """KeyError where no adapter has that name; requests running with it finish with it."""
        await self.between_steps(lambda: self.core.unload_adapter(name))

    async def between_steps(self, fn: Callable[[], T]) -> T:
        """fn() on the engine's thread, before its next step (or at once where the step loop is not running)."""
        if self._task is None or self._task.done():
            return await asyncio.wrap_future(self._executor.submit(fn))
        done: Future[T] = Future()
        with self._lock:
            ended = self._loop_ended  # its last drain of the calls is done: none would run this one
            if not ended:
                self._calls.append((fn, done))
        if ended:
            raise RuntimeError("the engine stopped")
        self._wake()
        return await asyncio.wrap_future(done)

    # ---- requests ----
    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Outputs:
        """Queues the request at once and returns its outputs as they come. The engine takes it at its next step
        whether or not the caller has started reading: a burst of requests reaches the engine as each is parsed, not
        once the event loop has got round to starting each one's response. Read the outputs to the end, or close
        them (`aclose`, `close`, or drop them): a request closed before its end is aborted."""
        if self._ended or (self._task is not None and self._task.done()):
            return Outputs.ended(
                RequestOutput(request_id, [], list(prompt_token_ids), finished=True, error=ENGINE_STOPPED)
            )
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = queue
        with self._lock:
            self._adds.append((request_id, list(prompt_token_ids), params))
        self._wake()
        return Outputs(queue, request_id, self, self.stream_interval)

    async def abort(self, request_id: str) -> None:
        self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        """Sync, from any thread (an Outputs being collected): the worker aborts it at its next step."""
        self._queues.pop(request_id, None)
        with self._lock:
            self._aborts.append(request_id)
        self._wake()

    def _wake(self) -> None:
        self._wakeup.set()

    # ---- the loop (on the engine thread) ----
    def _run(self) -> None:
        """Steps while there is work and sleeps when there is none. Each step's outputs are handed to the event loop
        without waiting for them to be delivered, so the next step starts at once (no round trip per step)."""
        try:
            while not self._stopping:
                self._wakeup.clear()
                if not self._has_pending():
                    self._wakeup.wait()
                    continue
                outputs = self._step()
                if outputs:
                    self._deliver_threadsafe(outputs)
        except Exception:
            log.exception("the engine loop died; the server can no longer serve")
        finally:
            with self._lock:
                calls, self._calls, self._loop_ended = self._calls, [], True
            for _, done in calls:
                done.set_exception(RuntimeError("the engine stopped"))
            self._deliver_threadsafe(None)

    def _deliver_threadsafe(self, outputs: list[RequestOutput] | None) -> None:
        if self._event_loop is None or self._event_loop.is_closed():
            return
        try:
            self._event_loop.call_soon_threadsafe(self._deliver, outputs)
        except RuntimeError:  # the event loop closed meanwhile: nobody is waiting any more
            pass

    def _deliver(self, outputs: list[RequestOutput] | None) -> None:
        """On the event loop: each output to its request's queue; None: the loop ended, every waiter gets an error."""
        if outputs is None:
            self._ended = True
            for request_id, queue in list(self._queues.items()):
                queue.put_nowait(RequestOutput(request_id, [], [], finished=True, error=ENGINE_STOPPED))
            return
        for out in outputs:
            waiting = self._queues.get(out.request_id)
            if waiting is not None:
                waiting.put_nowait(out)

    def _has_pending(self) -> bool:
        with self._lock:
            return bool(self._adds or self._aborts or self._calls or self.core.has_work)

    def _step(self) -> list[RequestOutput]:
        with self._lock:
            calls, self._calls = self._calls, []
        for fn, done in calls:
            try:
                done.set_result(fn())
            except Exception as exc:  # noqa: BLE001 (told to the caller, whose call it was)
                done.set_exception(exc)
        with self._lock:
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, []
            for request_id in aborts:
                self.core.abort(request_id)
            for request_id, ids, params in adds:
                if request_id not in aborts:
                    self.core.add_request(request_id, ids, params)
        try:
            return self.core.step()
        except Exception as exc:  # one bad step fails the requests in flight, not the server
            log.exception("engine step failed")
            with self._lock:
                return self.core.fail_all(f"engine error: {type(exc).__name__}: {exc}")


def adapter_fingerprint(model_fingerprint: str, digest: str) -> str:
    """The system_fingerprint of a model's responses with an adapter: its own, changed by the adapter's weights."""
    return "fp_" + hashlib.sha256(f"{model_fingerprint}|lora {digest}".encode()).hexdigest()[:12]
