"""AsyncEngine: the asyncio face of the engine, with the step loop running in one worker thread.

Requests and aborts arriving from the event loop are queued in an inbox that the worker drains at the start of every
step, so a request that arrives while others run joins the very next step (continuous batching), and an abort frees
its blocks within one step. Only the worker thread touches EngineCore. If the loop itself ends (stopped, or a bug),
every waiting caller gets a final error output instead of waiting forever, and `is_healthy()` turns false.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from torch import nn

from tokenmill import __version__
from tokenmill.config import Config
from tokenmill.engine.core import EngineCore, EngineStats, RequestState
from tokenmill.engine.kv_cache import BlockManager, kv_bytes_per_token
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.runner import ModelRunner
from tokenmill.engine.sampling import SamplingParams
from tokenmill.engine.scheduler import Scheduler
from tokenmill.model.loading.memory import release_freed_memory
from tokenmill.model.model_config import ModelConfig
from tokenmill.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_Add = tuple[str, list[int], SamplingParams]
T = TypeVar("T")
DEFAULT_MAX_MODEL_LEN = 8192
ENGINE_STOPPED = "the engine is not running"


def _engine_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-engine")


class AsyncEngine:
    def __init__(
        self, core: EngineCore, model_name: str, system_fingerprint: str, executor: ThreadPoolExecutor | None = None
    ) -> None:
        self.core = core
        self.tokenizer: Tokenizer = core.tokenizer
        self.model_name = model_name
        self.system_fingerprint = system_fingerprint
        self.max_model_len = core.max_model_len
        self._lock = threading.Lock()
        self._adds: list[_Add] = []
        self._aborts: list[str] = []
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._wakeup = threading.Event()
        self._stopping = False
        self._ended = False  # set on the event loop once the step loop has ended and its waiters were failed
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Future[None] | None = None
        self._executor = executor or _engine_thread()

    @classmethod
    def from_config(cls, config: Config) -> AsyncEngine:
        """Loads (or converts and caches) the model named by the config and builds the engine around it.

        The loading runs on the engine's own thread, the one that will run every step: torch work from a second thread
        gets OpenMP thread teams of its own, and two teams on two cores halved decode speed (62 → 34 tok/s).
        """
        executor = _engine_thread()
        core, name, fingerprint = executor.submit(cls._load, config).result()
        return cls(core, name, fingerprint, executor)

    @staticmethod
    def _load(config: Config) -> tuple[EngineCore, str, str]:
        import torch

        from tokenmill.model.loading.loader import load_model_files, save_prepared
        from tokenmill.model.registry import build_model

        if config.threads:
            torch.set_num_threads(config.threads)
        dtype, quantization = getattr(torch, config.dtype), config.weight_quantization
        loaded = load_model_files(config.model, config.cache_dir, dtype, quantization)
        model = build_model(loaded.config, loaded.state_dict, prepared=loaded.prepared)
        loaded.state_dict = {}  # the model holds what it uses; the rest (a replaced bf16 table) can go
        core = build_engine_core(model, loaded.tokenizer, config)
        if not loaded.prepared and loaded.cache_entry is not None and quantization != "none":
            save_prepared(model.state_dict(), loaded.cache_entry, dtype, quantization)
        release_freed_memory()
        name = config.served_model_name or loaded.name
        return core, name, system_fingerprint(loaded.source_id, config)

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
        self._executor.shutdown(wait=True)

    def is_healthy(self) -> bool:
        return self._task is not None and not self._task.done() and not self._ended

    def stats(self) -> EngineStats:
        with self._lock:
            return self.core.snapshot_stats()

    # ---- requests ----
    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        if self._ended or (self._task is not None and self._task.done()):
            yield RequestOutput(request_id, [], list(prompt_token_ids), finished=True, error=ENGINE_STOPPED)
            return
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = queue
        with self._lock:
            self._adds.append((request_id, list(prompt_token_ids), params))
        self._wake()
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
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
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _has_pending(self) -> bool:
        with self._lock:
            return bool(self._adds or self._aborts or self.core.has_work)

    def _step(self) -> list[RequestOutput]:
        with self._lock:
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, []
            for request_id in aborts:
                self.core.abort(request_id)
            for request_id, ids, params in adds:
                if request_id not in aborts:
                    self._add(request_id, ids, params)
        try:
            return self.core.step()
        except Exception as exc:  # one bad step fails the requests in flight, not the server
            log.exception("engine step failed")
            return self._fail_all(f"engine error: {type(exc).__name__}: {exc}")

    def _add(self, request_id: str, ids: list[int], params: SamplingParams) -> None:
        try:
            self.core.add_request(request_id, ids, params)
        except Exception as exc:  # a request the core cannot take fails alone
            log.exception("adding request %s failed", request_id)
            self.core.requests.setdefault(request_id, RequestState(ids, params))
            self.core.fail(request_id, f"{type(exc).__name__}: {exc}")

    def _fail_all(self, message: str) -> list[RequestOutput]:
        outputs = []
        with self._lock:
            for request_id, state in list(self.core.requests.items()):
                self.core.abort(request_id)
                outputs.append(RequestOutput(request_id, [], state.prompt_ids, finished=True, error=message))
        return outputs


def system_fingerprint(source_id: str, config: Config) -> str:
    """Changes when, and only when, something that can change outputs changes: weights, dtype, quantisation, version."""
    key = f"{source_id}|{config.dtype}|{config.weight_quantization}|{__version__}"
    return "fp_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def build_engine_core(model: nn.Module, tokenizer: Tokenizer, config: Config) -> EngineCore:
    """Sizes the KV cache from the config and wires the core's parts together (the model's linears are swapped)."""
    from tokenmill.model.linear import prepare_linears

    prepare_linears(model, config.weight_quantization)
    cfg: ModelConfig = model.config
    dtype = next(model.parameters()).dtype
    block_bytes = kv_bytes_per_token(cfg, dtype) * config.block_size
    num_blocks = config.num_kv_blocks or max((config.kv_cache_mb << 20) // block_bytes, 1)
    capacity = num_blocks * config.block_size
    model_len = cfg.max_position_embeddings
    max_model_len = min(config.max_model_len or min(model_len, DEFAULT_MAX_MODEL_LEN), model_len, capacity)
    blocks = BlockManager(num_blocks, config.block_size)
    scheduler = Scheduler(blocks, config.max_num_seqs, config.max_num_batched_tokens)
    runner = ModelRunner(model, cfg, num_blocks, config.block_size)
    return EngineCore(runner, tokenizer, blocks, scheduler, set(tokenizer.eos_ids), max_model_len)
