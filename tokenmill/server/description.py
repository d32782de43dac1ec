"""What an engine serves and on what, as the start-up banner says it: dtype, quantisation, KV capacity, C kernels.

The kernels are what the model and the sampler report of themselves (CausalLM.c_kernels, sampler.c_kernels), not
derived here from the settings: a model family's layers and activation decide which kernels run.
"""

from __future__ import annotations

from typing import Any

from tokenmill.config import Config
from tokenmill.engine.core import EngineCore
from tokenmill.engine.outputs import EngineDescription
from tokenmill.engine.sampler import c_kernels as sampler_kernels


def describe(core: EngineCore, config: Config) -> EngineDescription:
    """The engine as built from `config` (whose quantisation is the one run, see load.load_engine_core)."""
    report = core.runner.model.c_kernels(core.runner.dtype)
    return EngineDescription(
        dtype=config.dtype,
        quantization=config.weight_quantization,
        kv_cache_tokens=core.blocks.num_blocks * core.blocks.block_size,
        kernels=(*report.modules, *sampler_kernels(), *(("decoder_layer",) if report.decoder_layer else ())),
        **tier_facts(core),
    )


def tier_facts(core: EngineCore) -> dict[str, Any]:
    """The prefix cache's tiers as built: RAM's budget, and the disk tier's folder and budget where it is on."""
    tiers = core.blocks.tiers
    if tiers is None:
        return {}
    disk = tiers.disk if tiers.disk is not None and tiers.disk.enabled else None
    return {
        "kv_ram_bytes": tiers.ram.capacity,
        "kv_disk_dir": str(disk.folder) if disk else None,
        "kv_disk_bytes": disk.capacity if disk else 0,
    }
