"""Fill-in-the-middle tokens are found in each code model style's vocabulary and laid out prefix-suffix-middle."""

from __future__ import annotations

import pytest

from tests.tiny_model import tiny_fim_tokenizer, tiny_tokenizer
from tokenmill.tokenizer.fim import STYLES, FimStyle

NAMES = ["qwen-codegemma", "starcoder", "codellama"]


@pytest.mark.parametrize("style", STYLES, ids=NAMES)
def test_each_style_is_found_with_its_end_tokens(style: FimStyle) -> None:
    tok = tiny_fim_tokenizer(style)
    assert tok.fim is not None and tok.fim.style == style
    assert [tok.id_to_token(i) for i in (tok.fim.prefix, tok.fim.suffix, tok.fim.middle)] == [
        style.prefix,
        style.suffix,
        style.middle,
    ]
    assert [tok.id_to_token(i) for i in tok.fim_end_ids] == list(style.ends)


@pytest.mark.parametrize("style", STYLES, ids=NAMES)
def test_the_infill_prompt_is_prefix_suffix_middle(style: FimStyle) -> None:
    tok = tiny_fim_tokenizer(style)
    prefix, suffix = "def hello(", "):\n    return world\n"
    ids = tok.encode_infill(prefix, suffix)
    assert tok.fim is not None and tok.bos_id is not None
    expected = [tok.bos_id, tok.fim.prefix, *tok.encode(prefix, add_special_tokens=False), tok.fim.suffix]
    assert ids == [*expected, *tok.encode(suffix, add_special_tokens=False), tok.fim.middle]
    pre, suf, mid = (tok.decode([i]) for i in (tok.fim.prefix, tok.fim.suffix, tok.fim.middle))
    assert tok.decode(ids) == f"<bos>{pre}{prefix}{suf}{suffix}{mid}"


def test_a_vocabulary_without_the_three_tokens_has_no_fim() -> None:
    tok = tiny_tokenizer()
    assert tok.fim is None and not tok.supports_fim and tok.fim_end_ids == ()
    with pytest.raises(ValueError, match="fill-in-the-middle"):
        tok.encode_infill("a", "b")
    half = FimStyle("<|fim_prefix|>", "<|fim_suffix|>", "<no_such_token>", ())
    assert tiny_fim_tokenizer(half).fim is None
