"""Rebuild a Hugging Face `tokenizers` pipeline from a GGUF file's vocabulary.

A GGUF has no tokenizer.json, only llama.cpp's `tokenizer.ggml.*` metadata. These builders produce the same
normalizer / pre-tokenizer / BPE / decoder as `transformers` does for the same file, so ids agree with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

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
        tok, vocab = _gemma(tokens)
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


def _gemma(tokens: list[str]) -> tuple[HFTokenizer, dict[str, int]]:
    """Gemma stores runs of spaces as real spaces; the model pieces spell them ▁. Merges follow the file's order."""
    respelled = gemma_pieces(tokens)
    vocab = {t: i for i, t in enumerate(respelled)}
    tok = _sentencepiece_bpe(vocab, _merges_in_file_order(respelled, vocab), "<unk>" if "<unk>" in vocab else None)
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


def _merges_in_file_order(tokens: list[str], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """Every split of every token into two vocabulary pieces, ranked by the token's position, longer left first.

    Equals transformers' `generate_merges(vocab, {t: -index})` (Gemma's scores do not follow its merge order), which
    sorts by (score, len(left), len(right)) descending; this produces that order directly. `vocab`: the tokens'
    distinct strings. The splits are found by split_pairs (C or numpy, exact); where numpy's finds two of the
    vocabulary's strings sharing a hash it cannot decide, and the same list comes from slicing every token at every
    cut, ~1.2 million dictionary look-ups for Gemma 3's 262,144 pieces (docs/decisions/0017-startup-overlap.md has the times).
    """
    pairs = split_pairs(tokens, len(vocab))
    if pairs is None:
        return _merges_by_slicing(tokens, vocab)
    left, right = pairs
    return list(zip(map(tokens.__getitem__, left.tolist()), map(tokens.__getitem__, right.tolist())))


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
