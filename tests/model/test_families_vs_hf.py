"""Each supported family computes what `transformers` computes on the same weights: from its Hugging Face directory
and from the GGUF file llama.cpp's converter would write, logits within 1e-3 in float32; greedy tokens over HTTP."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from fastapi.testclient import TestClient
from gguf import GGMLQuantizationType as T

from tests.model.families import BY_NAME, FAMILIES, LONGROPE_ORIGINAL, SIZES, Family, write_gguf, write_hf_model
from tests.tokenizer.reference import TEXTS, assert_same_as_transformers
from tokenmill.api.app import create_app
from tokenmill.config import Config
from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.linear import prepare_linears
from tokenmill.model.loading.loader import load_model_files
from tokenmill.model.registry import build_model
from tokenmill.server.load import load_engine

IDS = torch.randint(3, SIZES["vocab_size"], (24,), generator=torch.Generator().manual_seed(1))  # < LONGROPE_ORIGINAL
NAMES = [f.name for f in FAMILIES]
BOS = 2  # the tiny tokenizer's (tests/tiny_model.py)


def ours(path: Path, cache: Path) -> CausalLM:
    loaded = load_model_files(str(path), str(cache), torch.float32, "none")
    return build_model(loaded.config, loaded.state_dict)


def reference_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids[None]).logits[0]  # (T, V)


class Files(NamedTuple):
    family: Family
    reference: torch.nn.Module  # transformers' model
    directory: Path  # saved by it
    gguf: Path  # the same weights as llama.cpp's converter writes them
    cache: Path


@pytest.fixture(scope="module", params=NAMES)
def files(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Files:
    family: Family = BY_NAME[request.param]
    root = tmp_path_factory.mktemp(family.name)
    model = write_hf_model(root / "hf", family)
    return Files(family, model, root / "hf", write_gguf(root / f"{family.name}.gguf", family, model), root / "cache")


def test_logits_from_the_hf_directory_equal_transformers(files: Files) -> None:
    model = ours(files.directory, files.cache)
    assert model.config.architecture == files.family.gguf_arch
    torch.testing.assert_close(model.forward_dense(IDS), reference_logits(files.reference, IDS), atol=1e-3, rtol=0)


def test_logits_from_the_gguf_file_equal_transformers(files: Files) -> None:
    model = ours(files.gguf, files.cache)
    assert model.config.architecture == files.family.gguf_arch
    torch.testing.assert_close(model.forward_dense(IDS), reference_logits(files.reference, IDS), atol=1e-3, rtol=0)


def test_the_quantised_paths_follow_the_float_model(files: Files, tmp_path: Path) -> None:
    """The bf16 serving paths: the HF directory as int8 tiles (its default) against transformers; a GGUF file in its
    own mixed block types (q, k, v of one layer in different types) against the same file dequantised to float32.
    Only bf16 and the int8 rounding of weights or activations separate them (~2% here). No argmax check: a random
    model's logits are flat, its best two often a near-tie."""
    path = write_gguf(tmp_path / "mixed.gguf", files.family, files.reference, quantize=[T.Q8_0, T.Q5_0, T.Q4_0])
    cases = [
        (files.directory, "int8", reference_logits(files.reference, IDS)),
        (path, "gguf", ours(path, tmp_path / "cache").forward_dense(IDS)),
    ]
    for source, quantization, reference in cases:
        loaded = load_model_files(str(source), str(tmp_path / "cache"), torch.bfloat16, quantization)
        model = build_model(loaded.config, loaded.state_dict, prepared=loaded.prepared, quantized=loaded.quantized)
        prepare_linears(model, quantization)
        logits = model.forward_dense(IDS)
        assert (logits - reference).norm() / reference.norm() < 0.05, quantization


def test_greedy_completion_over_http_equals_transformers_generate(files: Files) -> None:
    reference = files.reference
    prompt = [BOS, *IDS[:11].tolist()]  # as the tiny tokenizer starts every text
    eos = [1, 6]  # the tiny tokenizer's generation_config: the server stops at either, so does generate
    with torch.no_grad():
        generated = reference.generate(
            torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=eos, pad_token_id=0
        )[0, len(prompt) :].tolist()
    generated = generated[: next((i for i, t in enumerate(generated) if t in eos), len(generated))]
    with torch.no_grad():  # each generated token's log-probability, as transformers computes it
        logits = reference(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(generated)[:, None])[:, 0]
    config = Config(model=str(files.directory), cache_dir=str(files.cache), dtype="float32", quantization="none")
    engine = load_engine(config)
    with TestClient(create_app(engine, config)) as client:
        response = client.post(
            "/v1/completions",
            json={
                "model": engine.model_name,
                "prompt": prompt,
                "max_tokens": 10,
                "temperature": 0,
                "logprobs": 0,
                "return_tokens_as_token_ids": True,  # the tokens themselves, not the text each one adds
            },
        )
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{i}" for i in generated]
    torch.testing.assert_close(torch.tensor(logprobs["token_logprobs"]), expected, atol=1e-3, rtol=0)


def test_phi3_longrope_uses_the_long_factors_from_the_original_context_on(tmp_path: Path) -> None:
    """Per token: a position below the original context rotates by the short factors, one at or past it by the long
    ones — what transformers computes for a token decoded past that length with the earlier keys cached."""
    family = BY_NAME["phi3"]
    reference = write_hf_model(tmp_path / "hf", family)
    model = ours(tmp_path / "hf", tmp_path / "cache")
    ids = torch.randint(3, SIZES["vocab_size"], (LONGROPE_ORIGINAL + 3,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cached = reference(ids[None, :LONGROPE_ORIGINAL], use_cache=True).past_key_values
        expected = [reference(ids[None, LONGROPE_ORIGINAL:][:, :1], cache=cached, use_cache=True).logits[0, -1]]
    got = model.forward_dense(ids)
    torch.testing.assert_close(got[LONGROPE_ORIGINAL], expected[0], atol=1e-3, rtol=0)


def test_llama_gguf_tokenizer_matches_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    family = BY_NAME["llama"]
    model = write_hf_model(tmp_path / "hf", family)
    path = write_gguf(tmp_path / "llama.gguf", family, model)
    loaded = load_model_files(str(path), str(tmp_path / "cache"), torch.float32, "none")
    assert loaded.tokenizer.add_bos and loaded.tokenizer.bos_id == 2
    assert_same_as_transformers(loaded.tokenizer, AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name), TEXTS)


def test_an_unknown_architecture_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from tokenmill.cli import main

    write_hf_model(tmp_path / "hf", BY_NAME["llama"])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "model_type": "falcon"}))
    capsys.readouterr()  # transformers' progress bar from saving the model
    assert main(["models", "--model", str(tmp_path / "hf"), "--cache-dir", str(tmp_path / "cache")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "Traceback" not in error
    assert "'falcon'" in error and "qwen3" in error and "phi3" in error
