"""One typed, frozen config for the server and the engine.

CLI flags (`--max-num-seqs`) and environment variables (`TOKENMILL_MAX_NUM_SEQS`) are generated from the fields below,
so this file is the single place where a setting, its default and its meaning live.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

DEFAULT_MODEL_NAME = "gemma-3-270m"
DTYPES = ("float32", "bfloat16")
QUANTIZATIONS = ("none", "int8", "int4")


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class Config:
    # --- model ---
    model: str | None = _opt(None, "GGUF file or Hugging Face model directory; default: the packaged Gemma 3 270M")
    served_model_name: str | None = _opt(None, "model id in the API; default: gemma-3-270m, or the model's name")
    dtype: str = _opt(
        "bfloat16", "compute dtype; float32 gives logits equal to the transformers reference", choices=DTYPES
    )
    quantization: str | None = _opt(
        None,
        "weight-only quantisation of the linear layers and LM head; default: int8 with bfloat16, none with float32",
        choices=QUANTIZATIONS,
    )
    cache_dir: str | None = _opt(None, "where converted weights and tokenizers are cached; default: user cache dir")
    max_model_len: int | None = _opt(None, "context length served; default: min(model's, 8192)")
    # --- engine ---
    block_size: int = _opt(16, "tokens per KV-cache block")
    num_kv_blocks: int | None = _opt(None, "KV-cache blocks; default: sized from --kv-cache-mb")
    kv_cache_mb: int = _opt(512, "memory given to the KV cache, in MiB, when --num-kv-blocks is not set")
    max_num_seqs: int = _opt(64, "most sequences decoded in one step")
    max_num_batched_tokens: int = _opt(1024, "token budget of one engine step (prefill chunks + decodes)")
    threads: int | None = _opt(None, "torch intra-op threads; default: all cores")
    # --- server ---
    host: str = _opt("127.0.0.1", "address to listen on")
    port: int = _opt(8000, "port to listen on")
    api_key: tuple[str, ...] = _opt((), "accepted bearer key (repeatable); none: no auth", repeatable=True)
    log_level: str = _opt("info", "uvicorn and tokenmill log level")
    # --- limits: what one request may ask for, and how much may wait (see README "Robustness") ---
    max_waiting_requests: int = _opt(1024, "prompts admitted but not yet started; past it new requests get 429")
    max_waiting_tokens: int = _opt(1 << 20, "prompt tokens of the waiting prompts; past it new requests get 429")
    max_request_bytes: int = _opt(32 << 20, "largest request body accepted, in bytes")
    max_prompts_per_request: int = _opt(2048, "most prompts in one request")
    max_choices_per_request: int = _opt(4096, "most sequences one request may generate: prompts x max(n, best_of)")
    max_prompt_tokens_per_request: int = _opt(1 << 20, "most prompt tokens in one request, all prompts together")
    request_timeout_s: float = _opt(0.0, "end a completion still running after this many seconds (0: never)")
    shutdown_grace_s: float = _opt(30.0, "on SIGTERM, how long in-flight requests may take to finish")

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.weight_quantization != "none" and self.dtype != "bfloat16":
            raise ValueError("weight-only quantisation runs with bfloat16 activations: add --dtype bfloat16")
        if self.block_size <= 0 or self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be positive")
        if min(self.max_waiting_requests, self.max_waiting_tokens, self.max_request_bytes) <= 0:
            raise ValueError("max_waiting_requests, max_waiting_tokens and max_request_bytes must be positive")
        if self.request_timeout_s < 0 or self.shutdown_grace_s < 0:
            raise ValueError("request_timeout_s and shutdown_grace_s must not be negative")

    @property
    def weight_quantization(self) -> str:
        """The quantisation in force: the flag, else int8 for bfloat16 (the fast default) and none for float32."""
        if self.quantization is not None:
            return self.quantization
        return "int8" if self.dtype == "bfloat16" else "none"

    def with_overrides(self, **changes: Any) -> Config:
        return replace(self, **changes)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per Config field; unset flags stay None so env vars and defaults can fill them."""
    for f in fields(Config):
        meta = f.metadata
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": meta.get("help", "")}
        if meta.get("repeatable"):
            kwargs["action"] = "append"
        elif "choices" in meta:
            kwargs["choices"] = meta["choices"]
        else:
            kwargs["type"] = _field_type(f.default)
        parser.add_argument(_flag(f.name), **kwargs)


def _field_type(default: Any) -> Any:
    if isinstance(default, bool):
        return lambda s: s.lower() in ("1", "true", "yes")
    if isinstance(default, int):
        return int
    if isinstance(default, float):
        return float
    return str


def _from_env(name: str, default: Any) -> Any:
    raw = os.environ.get("TOKENMILL_" + name.upper())
    if raw is None:
        return MISSING
    if isinstance(default, tuple):
        return tuple(k for k in raw.split(",") if k)
    if default is None and name in ("max_model_len", "num_kv_blocks", "threads"):
        return int(raw)
    return _field_type(default)(raw) if default is not None else raw


def config_from_args(args: argparse.Namespace) -> Config:
    """CLI flag → TOKENMILL_* environment variable → field default."""
    values: dict[str, Any] = {}
    for f in fields(Config):
        cli = getattr(args, f.name, None)
        if cli is not None:
            values[f.name] = tuple(cli) if isinstance(f.default, tuple) else cli
            continue
        env = _from_env(f.name, f.default)
        if env is not MISSING:
            values[f.name] = env
    return Config(**values)
