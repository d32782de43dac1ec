"""Tokenizer: built from a GGUF vocabulary or a model directory, it must encode and decode like `transformers` and
like the family's own tokenizer.json (test_gguf.py compares with those on the real vocabularies)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_model import tiny_gguf_metadata, tiny_tokenizer
from tests.tokenizer.reference import TEXTS, assert_same_as_transformers
from tokenmill.kernels import ops
from tokenmill.tokenizer import Tokenizer, splits
from tokenmill.tokenizer.gguf import (
    _merges_by_rank,
    _merges_by_score,
    _merges_by_slicing,
    gemma_pieces,
    sentencepiece_scores,
)
from tokenmill.tokenizer.splits import split_pairs


# --- fast: the tiny model's tokenizer --------------------------------------------------------------------------------
def test_tiny_dir_tokenizer_matches_transformers(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours = Tokenizer.from_pretrained_dir(tiny_model_dir)
    assert_same_as_transformers(ours, AutoTokenizer.from_pretrained(tiny_model_dir), TEXTS)


def test_special_tokens_from_model_dir(tiny_model_dir: Path) -> None:
    tok = Tokenizer.from_pretrained_dir(tiny_model_dir)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (2, 1, 0)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<bos>", "<eos>", "<pad>")
    assert tok.add_bos and tok.vocab_size == 512
    assert tok.eos_ids == (1, 6)  # generation_config adds <end_of_turn>
    assert tok.encode("hello")[0] == 2 and tok.encode("hello", add_special_tokens=False)[0] != 2
    assert tok.id_to_token(5) == "<start_of_turn>"
    with pytest.raises(KeyError):
        tok.id_to_token(10_000)


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    tok = tiny_tokenizer()
    tok.save(tmp_path)
    again = Tokenizer.load(tmp_path)
    assert again.special == tok.special
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text)


def test_gguf_special_tokens_and_bytes() -> None:
    tok = Tokenizer.from_gguf(tiny_gguf_metadata())
    assert tok.add_bos and tok.encode("hi") == [2, *tok.encode("hi", add_special_tokens=False)]
    assert tok.encode("<start_of_turn>", add_special_tokens=False) == [5]
    assert tok.decode(tok.encode("\u00e9\U0001f389")) == "<bos>\u00e9\U0001f389"  # byte fallback both ways
    assert tok.decode([2, 5], skip_special_tokens=True) == ""


CONTROL, USER_DEFINED, NORMAL = 3, 4, 1  # llama.cpp token types


def gemma_whitespace_metadata(normal_scores: list[float] | None = None) -> dict:
    """A Gemma-shaped GGUF vocabulary as llama.cpp's converter writes one: runs of 2-8 real spaces as user-defined
    pieces scored -1000 (SentencePiece scores them 0), normal pieces with their scores."""
    normal = ["▁", "x", "y", "▁x", "▁y", "xy", "▁t", "t", "▁▁x"]
    scores = normal_scores or [-float(i) for i in range(len(normal))]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [" " * n for n in range(2, 9)] + normal
    return {
        "general.architecture": "gemma3",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [-1000.0] * 11 + scores,
        "tokenizer.ggml.token_type": [CONTROL] * 4 + [USER_DEFINED] * 7 + [NORMAL] * len(normal),
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
    }


def test_gemma_runs_of_spaces_longer_than_its_pieces_split_longest_first() -> None:
    """As Gemma's tokenizer.json ranks its merges (the whitespace pieces first, longest first): 9 spaces before "y"
    are 8 + "▁y"; ranked by file position, as transformers' GGUF conversion does, they were 4 + 5."""
    tok = Tokenizer.from_gguf(gemma_whitespace_metadata())
    eight, x, space_y = tok.token_to_id("▁" * 8), tok.token_to_id("x"), tok.token_to_id("▁y")
    assert tok.encode("x" + " " * 9 + "y", add_special_tokens=False) == [x, eight, space_y]
    assert tok.encode(" " * 17, add_special_tokens=False) == [eight, eight, tok.token_to_id("▁")]
    assert tok.decode(tok.encode("x" + " " * 9 + "y")) == "<bos>x" + " " * 9 + "y"


@pytest.mark.parametrize(
    "meta",
    [
        tiny_gguf_metadata(),  # every score 0: every pair ranked by its lengths
        gemma_whitespace_metadata(),  # scores that fall with the position: the split search's path
        gemma_whitespace_metadata([-1.0, -2, -3, -4, -5, -4, -7, -8, -9]),  # a score that rises: ranked by score
    ],
    ids=["tiny", "gemma-shaped", "unordered-scores"],
)
def test_gemma_merges_equal_transformers_sentencepiece_conversion(meta: dict) -> None:
    """transformers' `generate_merges` over the SentencePiece scores, which give the added pieces 0: the conversion
    that wrote Gemma's tokenizer.json."""
    from transformers.tokenization_utils_base import generate_merges

    pieces, types = gemma_pieces(meta["tokenizer.ggml.tokens"]), meta["tokenizer.ggml.token_type"]
    vocab = {t: i for i, t in enumerate(pieces)}
    scores = [0.0 if k in (CONTROL, USER_DEFINED) else s for s, k in zip(meta["tokenizer.ggml.scores"], types)]
    expected = generate_merges(vocab, dict(zip(pieces, scores)))
    assert _merges_by_rank(pieces, vocab, sentencepiece_scores(meta["tokenizer.ggml.scores"], types)) == expected


def found_splits(tokens: list[str], distinct: int) -> list[tuple[str, str]]:
    pairs = split_pairs(tokens, distinct)
    assert pairs is not None
    return [(tokens[left], tokens[right]) for left, right in zip(*(side.tolist() for side in pairs))]


@pytest.fixture(params=["c", "numpy"])
def search(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each split search in turn: the C kernels' pass (where built) and numpy's."""
    if request.param == "c" and ops.library() is None:
        pytest.skip("the C kernels are not built here")
    if request.param == "numpy":
        monkeypatch.setattr(splits, "_in_c", lambda *arrays: None)
    return str(request.param)


def test_split_pairs_equal_slicing_every_token_at_every_cut(search: str) -> None:
    """Code points past the BMP, a NUL, the empty string, a repeated token, one-code-point tokens: either search
    finds exactly the pairs that slicing finds, in the same order; with the hashes said to be ambiguous (a count of
    distinct strings they cannot reach) numpy's decides nothing and the merges come from slicing."""
    tokens = [
        "",
        "a",
        "b",
        "ab",
        "ba",
        "aba",
        "\U0001f389",
        "a\U0001f389",
        "\U0001f389\U0001f389a",
        "\x00",
        "a\x00b",
        "ab",
        "▁",
        "▁▁",
        "▁▁▁",
        "▁a",
        "abab",
        "babab",
        "x" * 40,
        "x" * 20,
        "x",
    ]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = found_splits(tokens, len(vocab))
    assert merges == _merges_by_slicing(tokens, vocab)
    assert ("a", "\U0001f389") in merges and ("x" * 20, "x" * 20) in merges and ("▁", "▁▁") in merges
    if search == "numpy":
        assert split_pairs(tokens, len(vocab) + 1) is None


def test_llama_merges_equal_transformers_generate_merges() -> None:
    from transformers.tokenization_utils_base import generate_merges

    tokens = ["<unk>", "a", "b", "c", "ab", "bc", "abc", "ca", "cab", "▁", "▁a"]
    scores = [0.0, -1, -1, -1, -2, -2, -3, -2, -4, -1, -2]
    vocab = {t: i for i, t in enumerate(tokens)}
    assert _merges_by_score(vocab, dict(zip(tokens, scores))) == generate_merges(vocab, dict(zip(tokens, scores)))


# --- end to end: the real GGUF vocabulary ----------------------------------------------------------------------------
@pytest.mark.e2e
def test_gemma_merges_from_split_pairs_equal_slicing_on_the_real_vocabulary(gguf_path: Path, search: str) -> None:
    from tokenmill.model.loading.gguf_file import read_gguf_file

    respelled = gemma_pieces(read_gguf_file(str(gguf_path))[0]["tokenizer.ggml.tokens"])
    vocab = {t: i for i, t in enumerate(respelled)}
    assert found_splits(respelled, len(vocab)) == _merges_by_slicing(respelled, vocab)  # no two strings share a hash


@pytest.mark.e2e
def test_gguf_tokenizer_matches_transformers(gguf_path: Path) -> None:
    import random

    from transformers import AutoTokenizer

    from tokenmill.model.loading.gguf_convert import read_gguf_tokenizer

    ours = read_gguf_tokenizer(str(gguf_path))
    theirs = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # transformers ranks Gemma's merges by file position: it agrees on these texts, whose runs of spaces are short,
    # and splits runs of 32 or more otherwise than Gemma's own tokenizer.json, the yardstick of test_gguf.py
    assert_same_as_transformers(ours, theirs, TEXTS)
    assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.vocab_size) == (2, 1, 0, 262_144)
    assert ours.encode("<start_of_turn>", add_special_tokens=False) == [105]
    rng = random.Random(0)
    ids = [rng.randrange(262_144) for _ in range(2000)]  # arbitrary ids, special and byte pieces included
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
