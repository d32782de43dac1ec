"""Byte-level BPE vocabularies (Llama 3, Qwen 2/2.5/3, StarCoder2, GPT-2) as their models ship them, and as a GGUF
file holds them: what the tests that rebuild them from a GGUF file compare.

Each family's tokenizer.json is made here the way its model ships it (its normalizer and pre-tokenizer: the split regex
or digit rule `tokenizer.ggml.pre` names), trained on a small corpus so every merge level occurs; the GGUF side is
written as llama.cpp's converter writes it (tokens, merges, token types, `pre`, BOS settings).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from tests.tokenizer.reference import TEXTS
from tokenmill.tokenizer.gguf import SPLIT_REGEXES

CONTROL, NORMAL = 3, 1
CODE = [
    "import numpy as np\nfor i in range(10):\n    print(i ** 2, np.sqrt(i))\n",
    "const x = await fetch(`/api/${id}`); // 12345 6789\n",
    "SELECT name, COUNT(*) FROM users WHERE age >= 21 GROUP BY name;\n",
    'fn main() { let v: Vec<u64> = (0..100).collect(); println!("{:?}", v); }\n',
]


@dataclass(frozen=True)
class Family:
    pre: str  # tokenizer.ggml.pre, as llama.cpp's converter names the family's pre-tokenizer
    specials: tuple[str, ...]
    bos: str | None  # added to every encoded text where set (Llama 3), as its tokenizer.json's post-processor does
    nfc: bool = False  # Qwen's tokenizer.json normalises to NFC


FAMILIES = {
    "llama-bpe": Family("llama-bpe", ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"), "<|begin_of_text|>"),
    "qwen2": Family("qwen2", ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>"), None, nfc=True),
    "starcoder": Family("starcoder", ("<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>"), None),
    "gpt-2": Family("gpt-2", ("<|endoftext|>",), None),
}


def own_tokenizer(family: Family) -> HFTokenizer:
    """The family's tokenizer.json as its models ship it, trained on the test texts."""
    tok = HFTokenizer(BPE(fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=family.pre == "gpt-2")
    if family.pre == "starcoder":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    elif family.pre in SPLIT_REGEXES:
        split = pre_tokenizers.Split(Regex(SPLIT_REGEXES[family.pre]), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    else:
        tok.pre_tokenizer = byte_level
    if family.nfc:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(TEXTS * 3 + CODE * 3, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family.specials])
    if family.bos is not None:
        bos_id = tok.token_to_id(family.bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{family.bos}:0 $A:0",
            pair=f"{family.bos}:0 $A:0 {family.bos}:1 $B:1",
            special_tokens=[(family.bos, bos_id)],
        )
    return tok


def gguf_metadata(family: Family, own: HFTokenizer) -> dict:
    """What llama.cpp's converter writes for a byte-level BPE vocabulary (as plain values, as our reader returns)."""
    import json

    model = json.loads(own.to_str())["model"]
    vocab = own.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    meta = {
        "general.architecture": {"llama-bpe": "llama", "qwen2": "qwen2", "starcoder": "starcoder2"}.get(
            family.pre, "gpt2"
        ),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": family.pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [CONTROL if t in family.specials else NORMAL for t in tokens],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": vocab[family.specials[0] if family.bos is None else family.specials[1]],
        "tokenizer.ggml.add_bos_token": family.bos is not None,
    }
    if family.bos is not None:
        meta["tokenizer.ggml.bos_token_id"] = vocab[family.bos]
    return meta
