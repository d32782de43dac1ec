"""What engine/build.py says of the engine it built (the description the start-up banner shows), and what a server
does with the objects loading left."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

from tests import tiny_model
from tests.engine import tiny
from tests.engine.tiny import ByteTokenizer, tiny_core
from tests.model.gguf_blocks import MIXED, native_model
from tokenmill.config import Config
from tokenmill.engine.build import ModelLoadError, build_engine_core, describe, freeze_loaded_objects, load_engine_core
from tokenmill.kernels import ops

BF16_ONLY = {"fused", "paged_attention", "gelu_mul", "silu_mul", "int8_matmul", "gguf_matmul", "gguf_amx"}
SMALL = {"block_size": 4, "num_kv_blocks": 32}


def test_the_description_gives_the_kv_capacity_in_tokens() -> None:
    config = Config(dtype="float32", block_size=4, num_kv_blocks=32)
    core = tiny_core(block_size=4, num_kv_blocks=32)
    description = describe(core, config)
    assert description.kv_cache_tokens == 32 * 4 == core.blocks.num_blocks * core.blocks.block_size
    assert (description.dtype, description.quantization) == ("float32", "none")


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


def test_freezing_after_loading_keeps_live_objects_out_of_collections_and_collects_garbage_first() -> None:
    class Node:
        other: object = None

    alive, garbage = Node(), Node()
    garbage.other = garbage  # a cycle: only the collector frees it
    dead = weakref.ref(garbage)
    del garbage
    try:
        freeze_loaded_objects()
        assert dead() is None  # collected first, not frozen
        assert gc.get_freeze_count() > 0
        assert not any(obj is alive for obj in gc.get_objects())  # in no generation a collection walks
    finally:
        gc.unfreeze()


def test_the_collector_a_start_turned_off_while_loading_is_on_again_once_the_objects_are_frozen() -> None:
    gc.disable()  # as cli.serve_forever does before the imports and the load
    try:
        freeze_loaded_objects()
        assert gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()


def test_a_gguf_vocabulary_no_builder_takes_fails_the_load_with_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tokenizer is built on a thread while the weights are regrouped; its error still fails the load as one."""
    meta = tiny_model.tiny_gguf_metadata()
    monkeypatch.setattr(tiny_model, "tiny_gguf_metadata", lambda: {**meta, "tokenizer.ggml.model": "bert"})
    path = tiny_model.write_tiny_gguf(tmp_path / "bert.gguf", quantize=True)
    with pytest.raises(ModelLoadError, match="unsupported GGUF tokenizer model 'bert'"):
        load_engine_core(Config(model=str(path), cache_dir=str(tmp_path / "cache")))
