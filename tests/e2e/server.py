"""The e2e tier's shared pieces: the served model's name, a handle on a running server, starting one, and the
`transformers` reference on the same weights. The fixtures that use them live in conftest.py."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import torch

from tests.api.server_process import serve_process

MODEL = "gemma-3-270m"
START_TIMEOUT_S = 300  # the very first start converts the GGUF file, later ones only load the converted weights


@dataclass
class Server:
    base_url: str

    def client(self, **kw: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0, timeout=120, **kw)

    def stats(self) -> dict[str, int]:
        return httpx.get(self.base_url + "/stats", timeout=10).json()


def serve(extra_args: list[str], log_dir: Path) -> Iterator[Server]:
    """The real server on the default model and cache dir, stopped with SIGINT as a user stops it (a failed start
    raises with its log's tail)."""
    flags = ["--log-level", "warning", *extra_args]
    log = log_dir / f"tokenmill-{time.monotonic_ns()}.log"
    with serve_process(flags, log, start_timeout_s=START_TIMEOUT_S, stop_signal=signal.SIGINT, grace_s=15) as server:
        yield Server(server.base_url)


@dataclass
class Reference:
    weights: Any  # tokenmill.model.loading.loader.LoadedWeights, float32
    model: Any  # transformers' Gemma3ForCausalLM on those weights, float32, eval mode

    def greedy(self, ids: list[int], max_new_tokens: int) -> list[int]:
        """transformers' own greedy continuation of `ids` (it may end early, at an EOS)."""
        with torch.no_grad():
            out = self.model.generate(
                torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
            )
        return out[0, len(ids) :].tolist()
