"""Rebuild a Hugging Face `tokenizers` pipeline from a GGUF file's vocabulary.

A GGUF has no tokenizer.json, only llama.cpp's `tokenizer.ggml.*` metadata. These builders produce the same
normalizer / pre-tokenizer / BPE / decoder as the family's own tokenizer.json, so ids agree with it (and with
`transformers` loading the file, except where its conversion ranks Gemma's merges by file position:
docs/decisions/0026-gemma-whitespace-runs.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from tokenmill.tokenizer.special import SpecialTokens
from tokenmill.tokenizer.splits import split_pairs


class UnsupportedTokenizerError(ValueError):
    """The GGUF names a tokenizer model (`tokenizer.ggml.model`) that no builder here reproduces."""


SPACE = "\u2581"  # SentencePiece's visible space
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types
KEY = "tokenizer.ggml."
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLIT_REGEXES = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
DIGIT_SPLITS = ("starcoder",)  # StarCoder / StarCoder2: each digit its own word, then GPT-2's regex
NFC_NORMALISED = ("qwen2",)  # Qwen's tokenizer.json normalises to NFC first


def build_gguf_tokenizer(meta: Mapping[str, Any]) -> tuple[HFTokenizer, SpecialTokens]:
    """`meta`: GGUF metadata as plain values (`tokenizer.ggml.tokens` a list of str, and so on)."""
    kind = meta.get(KEY + "model")
    tokens = list(meta[KEY + "tokens"])
    types = list(meta.get(KEY + "token_type") or [1] * len(tokens))
    if kind == "llama" and str(meta.get("general.architecture", "")).startswith("gemma"):
        tokens = gemma_pieces(tokens)  # the whitespace runs are added tokens: spelled as Gemma's tokenizer.json does
        tok, vocab = _gemma(tokens, sentencepiece_scores(meta.get(KEY + "scores"), types))
    elif kind == "llama":
        tok, vocab = _llama(tokens, meta[KEY + "scores"], bool(meta.get(KEY + "add_space_prefix", True)))
    elif kind == "gpt2":
        tok, vocab = _byte_level(tokens, meta[KEY + "merges"], meta.get(KEY + "pre"))
    else:
        raise UnsupportedTokenizerError(f"unsupported GGUF tokenizer model {kind!r}; supported: llama, gpt2")
    _add_typed_tokens(tok, tokens, types, vocab)
    return tok, _special_tokens(meta, tokens, kind)


def _special_tokens(meta: Mapping[str, Any], tokens: list[str], kind: str) -> SpecialTokens:
    def name(key: str) -> str | None:
        token_id = meta.get(KEY + key)
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
    add_bos = meta.get(KEY + "add_bos_token", kind == "llama")
    return SpecialTokens(
        bos_token=name("bos_token_id"),
        eos_token=name("eos_token_id"),
        pad_token=name("padding_token_id"),
        add_bos=bool(add_bos),
        add_eos=bool(meta.get(KEY + "add_eos_token", False)),
        extra_eos_tokens=tuple(t for t in (name("eot_token_id"), name("eom_token_id")) if t is not None),
    )


# --- the three vocabularies -----------------------------------------------------------------------------------------
def gemma_pieces(tokens: list[str]) -> list[str]:
    """Gemma's vocabulary as its model pieces spell it: a run of real spaces becomes a run of ▁."""
    return [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]


def sentencepiece_scores(scores: Sequence[float] | None, types: Sequence[int]) -> np.ndarray:
    """The pieces' SentencePiece scores. llama.cpp's converter keeps them for normal and byte pieces but writes -1000
    for the pieces it takes from the added tokens (control and user-defined: Gemma's runs of spaces, tabs and
    newlines), which SentencePiece scores 0, above every normal piece. Without scores: file order."""
    if scores is None:
        return -np.arange(len(types), dtype=np.float64)
    found = np.array(scores, dtype=np.float64)
    found[np.isin(np.asarray(types), (CONTROL, USER_DEFINED))] = 0.0
    return found


def _gemma(pieces: list[str], scores: np.ndarray) -> tuple[HFTokenizer, dict[str, int]]:
    """`pieces`: the vocabulary as the model spells it (gemma_pieces), `scores`: their SentencePiece scores."""
    vocab = {t: i for i, t in enumerate(pieces)}
    tok = _sentencepiece_bpe(vocab, _merges_by_rank(pieces, vocab, scores), "<unk>" if "<unk>" in vocab else None)
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok, vocab


def _llama(tokens: list[str], scores: Sequence[float], add_prefix_space: bool) -> tuple[HFTokenizer, dict[str, int]]:
    """Llama/Mistral SentencePiece: merges ranked by the tokens' scores; ▁ prefixed by Metaspace."""
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = _sentencepiece_bpe(vocab, _merges_by_score(vocab, dict(zip(tokens, scores))), None)
    scheme = "first" if add_prefix_space else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme=scheme, split=False)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok, vocab


def _byte_level(tokens: list[str], merges: Sequence[str], pre: str | None) -> tuple[HFTokenizer, dict[str, int]]:
    """GPT-2-style byte-level BPE (Llama 3, Qwen 2, StarCoder2): the file lists its merges; `pre` names the split
    before the bytes (a regex, or StarCoder's one digit at a time), as the family's own tokenizer.json does it."""
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [(left, right) for left, right in (m.split(" ", 1) for m in merges)]
    model = BPE(vocab=vocab, merges=pairs, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    tok = HFTokenizer(model)
    split = SPLIT_REGEXES.get(pre or "")
    if split is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in DIGIT_SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    else:  # GPT-2's own regex
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pre in NFC_NORMALISED:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    return tok, vocab


# --- helpers --------------------------------------------------------------------------------------------------------
def _sentencepiece_bpe(vocab: dict[str, int], merges: list[tuple[str, str]], unk: str | None) -> HFTokenizer:
    model = BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True, dropout=None)
    return HFTokenizer(model)


def _merges_by_rank(tokens: list[str], vocab: Mapping[str, int], scores: np.ndarray) -> list[tuple[str, str]]:
    """Every split of every piece into two vocabulary pieces, ranked as Gemma's tokenizer.json ranks them:
    transformers' SentencePiece conversion (`_merges_by_score`), by the merged piece's score, then the longer left
    piece, the longer right one, then file order.

    The pieces tied at the top score come first, longest first: the added ones (the runs of spaces, tabs and newlines
    among them) and any normal piece scored 0. So a run of 37 spaces is 31 + 6 spaces, as with Gemma's own tokenizer;
    ranked by file position, as transformers' GGUF conversion ranks them, it is 16 + 21
    (docs/decisions/0026-gemma-whitespace-runs.md). Below the top, a Gemma file's scores fall strictly with the
    position, so the rest is file order, token by token, longer left first: what split_pairs finds (C or numpy,
    exact; docs/decisions/0017-startup-overlap.md has the times). A file whose scores do not fall so, whose vocabulary
    repeats a string, or where numpy's search meets two strings sharing a hash, is ranked by `_merges_by_score`
    itself: ~1.2 million dictionary look-ups for Gemma 3's 262,144 pieces.
    """
    top = scores == scores.max() if len(scores) else np.zeros(0, bool)
    pairs = None
    if len(vocab) == len(tokens) and bool(np.all(np.diff(scores[~top]) < 0)):
        pairs = split_pairs(tokens, len(vocab))
    if pairs is None:
        return _merges_by_score(vocab, dict(zip(tokens, scores.tolist())))
    first = _merges_by_slicing([tokens[i] for i in np.flatnonzero(top).tolist()], vocab)
    first.sort(key=lambda m: (-len(m[0]), -len(m[1])))  # stable: file order among equal lengths
    left, right = pairs
    rest = _other_pairs(left, right, np.array([(vocab[a], vocab[b]) for a, b in first], np.int64).reshape(-1, 2))
    return first + list(
        zip(map(tokens.__getitem__, left[rest].tolist()), map(tokens.__getitem__, right[rest].tolist()))
    )


def _other_pairs(left: np.ndarray, right: np.ndarray, taken: np.ndarray) -> np.ndarray:
    """Positions of the (left, right) pairs not among `taken` (rows of ids). A pair makes one piece only, so this leaves
    out the top pieces' pairs; the exact look-up runs only where both ids occur in `taken` (~1,400 of ~515,000)."""
    n = int(max(left.max(initial=0), right.max(initial=0), taken.max(initial=0))) + 1
    lefts, rights = np.zeros(n, bool), np.zeros(n, bool)
    lefts[taken[:, 0]] = True
    rights[taken[:, 1]] = True
    maybe = np.flatnonzero(lefts[left] & rights[right])
    keep = np.ones(len(left), bool)
    keep[maybe[np.isin(left[maybe] * n + right[maybe], taken[:, 0] * n + taken[:, 1])]] = False
    return np.flatnonzero(keep)


def _merges_by_slicing(tokens: list[str], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    merges = []
    for token in tokens:
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges


def _merges_by_score(vocab: Mapping[str, int], scores: Mapping[str, float]) -> list[tuple[str, str]]:
    """transformers' `generate_merges(vocab, scores)`: pairs ranked by the merged token's score, ties by lengths."""
    found = []
    for token, score in scores.items():
        local = [
            (token[:k], token[k:], score) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab
        ]
        found.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _add_typed_tokens(tok: HFTokenizer, tokens: Sequence[str], types: Sequence[int], vocab: Mapping[str, int]) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens; both are matched whole."""
    control = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types) if k == CONTROL]
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    tok.add_special_tokens(control)
    tok.add_tokens([a for a in user if a.content in vocab])
