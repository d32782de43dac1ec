"""What server/description.py says of the engine it built: the dtype, quantisation, KV capacity and C kernels the
start-up banner shows, the kernels as the model and the sampler report them."""

from __future__ import annotations

from pathlib import Path

import torch

from tests import tiny_model
from tests.engine import tiny
from tests.engine.tiny import ByteTokenizer, tiny_core
from tests.model.gguf_blocks import MIXED, native_model
from tokenmill.config import Config
from tokenmill.kernels import ops
from tokenmill.server.description import describe
from tokenmill.server.engine_core import build_engine_core

BF16_ONLY = {"fused", "paged_attention", "gelu_mul", "silu_mul", "int8_matmul", "gguf_matmul", "gguf_amx"}
SMALL = {"block_size": 4, "num_kv_blocks": 32}


def test_the_description_gives_the_kv_capacity_in_tokens() -> None:
    config = Config(dtype="float32", block_size=4, num_kv_blocks=32)
    core = tiny_core(block_size=4, num_kv_blocks=32)
    description = describe(core, config)
    assert description.kv_cache_tokens == 32 * 4 == core.blocks.num_blocks * core.blocks.block_size
    assert (description.dtype, description.quantization) == ("float32", "none")


def test_the_description_names_the_prefix_cache_tiers(tmp_path: Path) -> None:
    config = Config(dtype="float32", kv_cache_ram_gb=0.5, kv_cache_dir=str(tmp_path), kv_cache_disk_gb=2)
    core = tiny_core(kv_cache_ram_gb=0.5, kv_cache_dir=str(tmp_path), kv_cache_disk_gb=2)
    description = describe(core, config)
    assert description.kv_ram_bytes == 1 << 29 and description.kv_disk_bytes == 2 << 30
    assert description.kv_disk_dir is not None and Path(description.kv_disk_dir).parent == tmp_path
    core.close()
    bare = describe(tiny_core(kv_cache_ram_gb=0), Config(dtype="float32", kv_cache_ram_gb=0))
    assert (bare.kv_ram_bytes, bare.kv_disk_dir, bare.kv_disk_bytes) == (0, None, 0)


def _int8_kernels() -> set[str]:
    config = Config(dtype="bfloat16", quantization="int8", **SMALL)  # type: ignore[arg-type]
    core = build_engine_core(tiny.tiny_model().to(torch.bfloat16), ByteTokenizer(), config)  # type: ignore[arg-type]
    return set(describe(core, config).kernels)


def _gguf_kernels(tmp_path: Path) -> set[str]:
    config = Config(dtype="bfloat16", **SMALL)  # type: ignore[arg-type]
    model = native_model(tiny_model.write_tiny_gguf(tmp_path / "mixed.gguf", quantize=MIXED), tmp_path / "cache")
    return set(describe(build_engine_core(model, tiny_model.tiny_tokenizer(), config), config).kernels)


def test_float32_calls_no_bf16_kernel() -> None:
    kernels = set(describe(tiny_core(), Config(dtype="float32")).kernels)
    assert not BF16_ONLY & kernels and "decoder_layer" not in kernels
    assert ("argmax" in kernels) == ops.argmax_available()


def test_each_quantisation_names_its_own_matmul_kernel_where_it_was_built(tmp_path: Path) -> None:
    int8, gguf = _int8_kernels(), _gguf_kernels(tmp_path)
    assert ("int8_matmul" in int8) == ops.int8_matmul_available() and "gguf_matmul" not in int8
    assert ("gguf_matmul" in gguf) == ops.gguf_matmul_available() and "int8_matmul" not in gguf
    assert ("gguf_amx" in gguf) == ops.gguf_amx() and "gguf_amx" not in int8
    assert ("fused" in int8) == (ops.library() is not None)


def test_a_model_names_its_own_activation_kernel() -> None:
    assert ("gelu_mul" in _int8_kernels()) == ops.gelu_mul_available()  # a Gemma: GELU-gated
    assert "silu_mul" not in _int8_kernels()


def test_the_banner_leaves_amx_out_when_it_is_not_wanted(tmp_path: Path) -> None:
    was = ops.gguf_amx()
    try:
        ops.gguf_amx(False)
        assert "gguf_amx" not in _gguf_kernels(tmp_path)
    finally:
        ops.gguf_amx(was)
