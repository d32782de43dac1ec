"""From a Config to a ready engine: load (or convert and cache) the model, build the engine around it, describe it.

What is built is decided here; where it runs is the engine's own thread (load_engine), the one that will run every
step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.config import Config
from tokenmill.engine.core import EngineCore
from tokenmill.engine.engine import AsyncEngine, engine_thread
from tokenmill.engine.kv_cache import KVCacheFormatError
from tokenmill.engine.outputs import EngineDescription
from tokenmill.model.loading.memory import release_freed_memory, unmap_file_pages
from tokenmill.model.lora import AdapterError, base_state_dict
from tokenmill.server.description import describe
from tokenmill.server.engine_core import build_engine_core
from tokenmill.server.fingerprint import system_fingerprint
from tokenmill.tokenizer import Tokenizer


class ModelLoadError(Exception):
    """The model the config names cannot be served (an architecture, tokenizer or file this engine does not take, or
    no such path): the message says which and why, in one line for the command line to print."""


@dataclass(frozen=True)
class LoadedEngine:
    core: EngineCore
    model_name: str  # what the API reports as `model`
    system_fingerprint: str
    description: EngineDescription


def load_engine(config: Config) -> AsyncEngine:
    """Loads (or converts and caches) the model named by the config and builds the engine around it.

    The loading runs on the engine's own thread, the one that will run every step: torch work from a second thread
    gets OpenMP thread teams of its own, and two teams contending for the same cores slow every decode step down.
    """
    executor = engine_thread()
    loaded = executor.submit(load_engine_core, config).result()
    return AsyncEngine(
        loaded.core,
        loaded.model_name,
        loaded.system_fingerprint,
        executor,
        loaded.description,
        config.stream_interval,
    )


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
    fingerprint = system_fingerprint(loaded.source_id, config)
    name = config.served_model_name[0] if config.served_model_name else loaded.name
    try:
        core = build_engine_core(model, tokenizer, config, fingerprint, name)
    except (KVCacheFormatError, AdapterError) as exc:
        raise ModelLoadError(str(exc)) from exc
    if not loaded.prepared and loaded.cache_entry is not None and quantization not in ("none", "gguf"):
        save_prepared(base_state_dict(model), loaded.cache_entry, dtype, quantization)
    release_freed_memory()
    return LoadedEngine(core, name, fingerprint, describe(core, config))


def load_tokenizer(config: Config) -> Tokenizer:
    """The model's tokenizer alone, its weights never read (a simulated engine replica's: cluster/simulated.py)."""
    from tokenmill.model.loading.gguf_file import read_gguf_file
    from tokenmill.model.loading.identity import cache_root
    from tokenmill.model.loading.loader import is_gguf, packaged_gguf

    path = config.model_path
    if path is None:  # the packaged model's file
        path = str(packaged_gguf(cache_root(config.cache_dir)))
    if is_gguf(path):
        return Tokenizer.from_gguf(read_gguf_file(path)[0])
    return Tokenizer.from_pretrained_dir(path)
