"""From a model and its tokenizer to an EngineCore: the linears prepared, the KV cache sized from the config, and
the core's parts (block manager, scheduler, model runner) wired together."""

from __future__ import annotations

from tokenmill.config import Config
from tokenmill.engine.adapters import AdapterRegistry
from tokenmill.engine.core import EngineCore
from tokenmill.engine.kv_cache import BlockManager, kv_bytes_per_token
from tokenmill.engine.kv_tiers import KVTiers
from tokenmill.engine.runner import ModelRunner
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.speculation import SpeculativeConfig
from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.linear import prepare_linears
from tokenmill.tokenizer import Tokenizer

DEFAULT_MAX_MODEL_LEN = 8192


def build_engine_core(
    model: CausalLM, tokenizer: Tokenizer, config: Config, identity: str = "", model_name: str = "the model"
) -> EngineCore:
    """Sizes the KV cache from the config and wires the core's parts together (the model's linears are swapped, and
    wrapped for LoRA adapters where the config serves any, with its --lora loaded: AdapterError where one cannot be).
    `identity` (the system fingerprint) names what the KV bytes depend on, for the prefix cache's disk tier."""
    prepare_linears(model, config.weight_quantization)
    adapters = None
    if config.lora or config.allow_runtime_lora:
        adapters = AdapterRegistry(model, model_name, config.max_loras, config.max_lora_rank)
        for name, path in config.lora_modules:
            adapters.load(name, path)
    cfg = model.config
    dtype = next(model.parameters()).dtype
    block_bytes = kv_bytes_per_token(cfg, dtype, config.kv_cache_dtype) * config.block_size
    num_blocks = config.num_kv_blocks or max((config.kv_cache_mb << 20) // block_bytes, 1)
    capacity = num_blocks * config.block_size
    model_len = cfg.max_position_embeddings
    max_model_len = min(config.max_model_len or min(model_len, DEFAULT_MAX_MODEL_LEN), model_len, capacity)
    runner = ModelRunner(model, cfg, num_blocks, config.block_size, config.kv_cache_dtype)
    blocks = BlockManager(num_blocks, config.block_size, kv_tiers(runner, config, identity))
    scheduler = Scheduler(blocks, config.max_num_seqs, config.max_num_batched_tokens, config.max_num_prefills)
    spec = config.speculative_settings()
    speculative = SpeculativeConfig(
        method=spec["method"],
        num_tokens=spec["num_speculative_tokens"],
        min_ngram=spec["prompt_lookup_min"],
        max_ngram=spec["prompt_lookup_max"],
        store_tokens=spec["suffix_store_tokens"],
        min_share=float(spec["suffix_decoding_min_token_prob"]),
        corpus=spec["suffix_corpus"],
    )
    eos = set(tokenizer.eos_ids)
    return EngineCore(runner, tokenizer, blocks, scheduler, eos, max_model_len, speculative, adapters)


def kv_tiers(runner: ModelRunner, config: Config, identity: str) -> KVTiers | None:
    """The prefix cache's RAM and disk tiers as the config sizes them; None where both are off."""
    ram_bytes = int(config.ram_tier_gb * (1 << 30))
    disk_bytes = int(config.kv_cache_disk_gb * (1 << 30)) if config.kv_cache_dir else 0
    if ram_bytes <= 0 and disk_bytes <= 0:
        return None
    return KVTiers(runner.kv_caches, config.block_size, ram_bytes, config.kv_cache_dir, disk_bytes, identity)
