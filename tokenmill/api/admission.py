"""Who may start a completion now: 503 while draining or with a dead engine, 429 once too much is waiting.

A prompt is *waiting* from its admission until its first engine output (it is then running, or at least prefilled).
Past `max_waiting_requests` waiting prompts or `max_waiting_tokens` of their prompt tokens, new requests are refused at
once with 429 and `Retry-After`; admitted ones are never touched. An empty queue admits anything, so a request that
is within the per-request limits can always eventually run. Everything here runs on the event loop: no locks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from tokenmill.api import errors
from tokenmill.config import Config

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1


class Admission:
    def __init__(self, max_waiting_requests: int, max_waiting_tokens: int) -> None:
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_tokens = max_waiting_tokens
        self.waiting_requests = 0
        self.waiting_tokens = 0
        self.in_flight = 0  # admitted completions not yet finished (what a drain waits for)
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    @classmethod
    def from_config(cls, config: Config) -> Admission:
        return cls(config.max_waiting_requests, config.max_waiting_tokens)

    def check_open(self, engine_healthy: bool) -> None:
        if self.draining:
            raise errors.service_unavailable("The server is shutting down; retry on another replica.", RETRY_AFTER_S)
        if not engine_healthy:
            raise errors.service_unavailable("The engine is not running; the server cannot serve.", RETRY_AFTER_S)

    def admit(self, prompt_lengths: Sequence[int]) -> Ticket:
        """Reserve room for these prompts or raise 429."""
        count, tokens = len(prompt_lengths), sum(prompt_lengths)
        if self.waiting_requests and self.waiting_requests + count > self.max_waiting_requests:
            raise errors.rate_limited(
                f"The server is at capacity: {self.waiting_requests} prompts are waiting "
                f"(limit {self.max_waiting_requests}). Please retry after a short wait.",
                "requests",
                RETRY_AFTER_S,
                reason="busy_requests",
            )
        if self.waiting_tokens and self.waiting_tokens + tokens > self.max_waiting_tokens:
            raise errors.rate_limited(
                f"The server is at capacity: {self.waiting_tokens} prompt tokens are waiting "
                f"(limit {self.max_waiting_tokens}). Please retry after a short wait.",
                "tokens",
                RETRY_AFTER_S,
                reason="busy_tokens",
            )
        self.waiting_requests += count
        self.waiting_tokens += tokens
        self.in_flight += 1
        self._idle.clear()
        return Ticket(self, list(prompt_lengths))

    def begin_drain(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once nothing is in flight; False if `timeout_s` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def _release(self, count: int, tokens: int) -> None:
        self.waiting_requests -= count
        self.waiting_tokens -= tokens

    def _leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()


class Ticket:
    """One admitted completion: its prompts leave the waiting count as they start, everything on close."""

    def __init__(self, admission: Admission, prompt_lengths: list[int]) -> None:
        self._admission = admission
        self._waiting = dict(enumerate(prompt_lengths))  # prompt index → prompt tokens, while waiting
        self._closed = False

    def started(self, prompt_index: int) -> None:
        tokens = self._waiting.pop(prompt_index, None)
        if tokens is not None:
            self._admission._release(1, tokens)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._admission._release(len(self._waiting), sum(self._waiting.values()))
        self._waiting.clear()
        self._admission._leave()
