"""From a Config to a ready EngineCore: load (or convert and cache) the model, size the KV cache, wire the parts.

The async front (engine.py) only decides where this runs (on the engine's own thread); what is built is decided here.
"""

from __future__ import annotations

import gc
import hashlib
from dataclasses import dataclass

import torch

from tokenmill import __version__
from tokenmill.config import Config
from tokenmill.engine.core import EngineCore
from tokenmill.engine.kv_cache import BlockManager, kv_bytes_per_token
from tokenmill.engine.outputs import EngineDescription
from tokenmill.engine.runner import ModelRunner
from tokenmill.engine.sampler import c_kernels as sampler_kernels
from tokenmill.engine.scheduler import Scheduler
from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.loading.memory import release_freed_memory, unmap_file_pages
from tokenmill.tokenizer import Tokenizer

DEFAULT_MAX_MODEL_LEN = 8192


class ModelLoadError(Exception):
    """The model the config names cannot be served (an architecture, tokenizer or file this engine does not take, or
    no such path): the message says which and why, in one line for the command line to print."""


@dataclass(frozen=True)
class LoadedEngine:
    core: EngineCore
    model_name: str  # what the API reports as `model`
    system_fingerprint: str
    description: EngineDescription


def load_engine_core(config: Config) -> LoadedEngine:
    """Loads the model the config names, prepares its linears, and caches the prepared weights for the next start."""
    from tokenmill.model.loading.gguf_file import GgufFormatError
    from tokenmill.model.loading.loader import is_gguf, load_model_files, save_prepared
    from tokenmill.model.model_config import UnsupportedModelError
    from tokenmill.model.registry import build_model
    from tokenmill.tokenizer.gguf import UnsupportedTokenizerError

    if config.threads:
        torch.set_num_threads(config.threads)
    dtype, quantization = getattr(torch, config.dtype), config.weight_quantization
    if quantization == "gguf" and not is_gguf(config.model_path):
        config = config.with_overrides(quantization="int8")  # no GGUF blocks to keep: the float checkpoint's path
        quantization = "int8"
    try:
        loaded = load_model_files(config.model_path, config.cache_dir, dtype, quantization)
        model = build_model(
            loaded.config, loaded.state_dict, loaded.prepared, loaded.quantized, greedy_head=config.greedy_head
        )
        tokenizer = loaded.tokenizer  # a GGUF's was built on a thread meanwhile
    except (UnsupportedModelError, UnsupportedTokenizerError, GgufFormatError, FileNotFoundError) as exc:
        raise ModelLoadError(str(exc)) from exc
    loaded.state_dict, loaded.quantized = {}, {}  # the model holds what it uses; the rest can go
    if loaded.mapped is not None:  # the file's pages read to regroup blocks: the page cache keeps them, RSS need not
        unmap_file_pages(*loaded.mapped)
    core = build_engine_core(model, tokenizer, config)
    if not loaded.prepared and loaded.cache_entry is not None and quantization not in ("none", "gguf"):
        save_prepared(model.state_dict(), loaded.cache_entry, dtype, quantization)
    release_freed_memory()
    name = config.served_model_name[0] if config.served_model_name else loaded.name
    return LoadedEngine(core, name, system_fingerprint(loaded.source_id, config), describe(core, config))


def freeze_loaded_objects() -> None:
    """Once a process has loaded its models: collect, then move every object still alive (the imported libraries'
    modules, functions and classes, the models' and tokenizers' Python side: ~180,000 objects with the default model)
    into the collector's permanent generation (gc.freeze), which its collections no longer walk.

    Why: they live as long as the process, yet each full collection would walk them all, ~0.1 s holding the GIL, and
    every stream stalls meanwhile (the engine thread needs the GIL between its C calls). A long-running server reaches
    full collections as its requests' longer-lived objects pile up. Objects made later are collected as before: the
    collector is turned back on here where a start turned it off while loading (cli.serve_forever)."""
    gc.collect()
    gc.freeze()
    gc.enable()


def system_fingerprint(source_id: str, config: Config) -> str:
    """Changes when, and only when, something that can change outputs changes: weights, dtype, quantisation, version."""
    key = f"{source_id}|{config.dtype}|{config.weight_quantization}|{__version__}"
    return "fp_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def describe(core: EngineCore, config: Config) -> EngineDescription:
    """The engine as built from `config` (whose quantisation is the one run, see load_engine_core); its C kernels as
    the model and the sampler report them."""
    report = core.runner.model.c_kernels(core.runner.dtype)
    return EngineDescription(
        dtype=config.dtype,
        quantization=config.weight_quantization,
        kv_cache_tokens=core.blocks.num_blocks * core.blocks.block_size,
        kernels=(*report.modules, *sampler_kernels(), *(("decoder_layer",) if report.decoder_layer else ())),
    )


def build_engine_core(model: CausalLM, tokenizer: Tokenizer, config: Config) -> EngineCore:
    """Sizes the KV cache from the config and wires the core's parts together (the model's linears are swapped)."""
    from tokenmill.model.linear import prepare_linears

    prepare_linears(model, config.weight_quantization)
    cfg = model.config
    dtype = next(model.parameters()).dtype
    block_bytes = kv_bytes_per_token(cfg, dtype) * config.block_size
    num_blocks = config.num_kv_blocks or max((config.kv_cache_mb << 20) // block_bytes, 1)
    capacity = num_blocks * config.block_size
    model_len = cfg.max_position_embeddings
    max_model_len = min(config.max_model_len or min(model_len, DEFAULT_MAX_MODEL_LEN), model_len, capacity)
    blocks = BlockManager(num_blocks, config.block_size)
    scheduler = Scheduler(blocks, config.max_num_seqs, config.max_num_batched_tokens, config.max_num_prefills)
    runner = ModelRunner(model, cfg, num_blocks, config.block_size)
    return EngineCore(runner, tokenizer, blocks, scheduler, set(tokenizer.eos_ids), max_model_len)
