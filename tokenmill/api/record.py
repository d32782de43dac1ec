"""What one completion did, once it is over: told to the metrics and written in its access-log line.

A record holds only what may be logged: token counts, timings, finish reasons, the `user` field hashed, and the prompt
and output texts only when the server logs prompts (`--log-prompts`). Times are seconds; a timing the completion never
reached (no token generated, no end) is None and is neither observed nor logged.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

USER_HASH_CHARS = 16  # 64 bits of sha256: unique among any realistic number of users


@dataclass(frozen=True)
class PromptRecord:
    """One prompt of a completion: one engine request, with its n (or best_of) choices."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int  # all its choices together
    started: bool  # the engine answered it (its first output arrived)
    admission_wait_s: float | None  # admitted → first engine output
    ttft_s: float | None  # request arrival → first generated token
    tpot_s: float | None  # mean time between its tokens after the first (longest choice); None below two tokens
    e2e_s: float | None  # request arrival → its last output, when it finished


@dataclass(frozen=True)
class CompletionRecord:
    model: str
    completion_id: str
    stream: bool
    prompts: list[PromptRecord]
    finish_reasons: list[str]  # per choice, in choice order (best_of candidates included)
    outcome: str  # "ok", "client_gone" (disconnected or cancelled first), "timeout", "error"
    error_status: int | None = None  # the status of the error it ended with (a stream's error frame included)
    error_code: str | None = None
    user: str | None = None  # pseudonym(request.user)
    prompt: Any = None  # the prompt as sent (text or token ids) and each choice's text: only with --log-prompts
    outputs: list[str] | None = None

    @property
    def prompt_tokens(self) -> int:
        """The prompt tokens the engine took in (all of them, unless the completion ended before some started)."""
        return sum(p.prompt_tokens for p in self.prompts if p.started)

    @property
    def cached_tokens(self) -> int:
        return sum(p.cached_tokens for p in self.prompts if p.started)

    @property
    def completion_tokens(self) -> int:
        return sum(p.completion_tokens for p in self.prompts)

    @property
    def ttft_s(self) -> float | None:
        """The first token of any prompt."""
        return min((p.ttft_s for p in self.prompts if p.ttft_s is not None), default=None)


def pseudonym(text: str) -> str:
    """What a `user` (in the log, /metrics and the rate limiter) or an API key (in the rate limiter) is known by: an
    unsalted sha256 prefix. Unsalted on purpose: the same user reads the same in every process and after restarts,
    and an operator can find a known user's lines by hashing the id. It hides the id from a log reader; it does not
    stop someone guessing a short, predictable id (send opaque ids)."""
    return hashlib.sha256(text.encode()).hexdigest()[:USER_HASH_CHARS]
