"""The --lora run's pieces: its random adapters (the GGUF file holds the PEFT directory's update, as llama.cpp's
converter writes it), each system's request bodies, and its table on the performance page."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from tests.bench.bench_runs import ZEN4, bench_run
from tests.bench.fake_openai import FakeOpenAI
from tests.model.families import BY_NAME, write_hf_model
from tokenmill.bench import render
from tokenmill.bench.load import LoadSettings, bench_url
from tokenmill.bench.lora import write_gguf_lora, write_random_adapter
from tokenmill.bench.lora_run import _lora_lists, _models
from tokenmill.model.loading.loader import load_model_files
from tokenmill.model.lora import read_adapter


@pytest.mark.parametrize("family", ["llama", "starcoder2"])
def test_the_gguf_lora_holds_the_peft_adapters_update(tmp_path: Path, family: str) -> None:
    write_hf_model(tmp_path / "hf", BY_NAME[family])
    config = load_model_files(str(tmp_path / "hf"), str(tmp_path / "cache"), torch.float32).config
    peft = read_adapter(str(write_random_adapter(tmp_path / "a", config, rank=4, seed=1)), config)
    gguf = read_adapter(str(write_gguf_lora(tmp_path / "a.gguf", tmp_path / "a", config)), config)
    assert len(peft.modules) == config.num_layers * (6 if family == "starcoder2" else 7) and peft.rank == 4
    assert sorted(gguf.modules) == sorted(peft.modules)
    for name, update in peft.modules.items():
        other = gguf.modules[name]  # llama's q and k rows permuted there, and back
        torch.testing.assert_close(other.b @ other.a * other.scale, update.b @ update.a * update.scale)


def test_request_i_takes_adapter_i_modulo_their_number_and_the_single_stream_the_first() -> None:
    fake = FakeOpenAI()
    settings = LoadSettings(
        max_tokens=3, single_runs=2, concurrency=(3,), requests=5, prefill_tokens=(), variants=_models(2)
    )
    with fake.running() as url:
        asyncio.run(asyncio.wait_for(bench_url(url, settings), timeout=30))
    models = [body["model"] for body in fake.bodies if body.get("stream")]
    assert models[:3] == ["adapter0"] * 3  # the warm-up and the single stream
    assert sorted(models[3:]) == sorted(f"adapter{i % 2}" for i in range(5))
    assert _lora_lists(2)[1] == {"lora": [{"id": 1, "scale": 1.0}]}


def test_a_lora_run_gets_its_table_after_the_standard_and_workload_runs(tmp_path: Path) -> None:
    figures = {"decode_tok_s": 62.2, "c16_agg_tok_s": 400.0}
    standard = bench_run(ZEN4, {"tokenmill": figures}, "2026-12-07T10:00:00Z", 25.0)
    lora = bench_run(ZEN4, {"tokenmill+lora": figures, "tokenmill": figures}, "2026-12-07T11:00:00Z", 25.0)
    lora["meta"]["lora"] = {"adapters": 4, "rank": 16, "targets": "every linear of every layer"}  # type: ignore[index]
    page = render.render([("a.json", lora), ("b.json", standard)])
    standard_at, lora_at = (
        page.index("### gemma-3-270m-q4_k_m.gguf\n"),
        page.index("### gemma-3-270m-q4_k_m.gguf, 4 LoRA"),
    )
    assert standard_at < lora_at and "4 random LoRA adapters of rank 16" in page[lora_at:]
