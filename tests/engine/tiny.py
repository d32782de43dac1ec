"""A tiny random-weight Gemma 3 and a byte-level tokenizer: the engine's fast tests need no files at all.

Also the helpers those tests share: running a core to the end, reading a choice's tokens, greedy parameters, and
poisoning chosen sequences' hidden states.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenmill.config import Config
from tokenmill.engine.core import EngineCore
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.sampling import SamplingParams
from tokenmill.engine.scheduler import Scheduled
from tokenmill.engine.sequence import Sequence
from tokenmill.engine.speculation import MAX_FIXED_ROWS, StepCost
from tokenmill.model.gemma3 import Gemma3ForCausalLM
from tokenmill.model.model_config import ModelConfig
from tokenmill.server.engine_core import build_engine_core

NUM_SPECIAL = 4  # 0 <pad>, 1 <eos>, 2 <bos>, 3 <unk>; then one token per byte
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]


class ByteTokenizer:
    """Token id 4 + b for byte b: multi-byte characters span tokens, as byte-fallback pieces do."""

    vocab_size = NUM_SPECIAL + 256
    pad_id, eos_id, bos_id = 0, 1, 2
    pad_token, eos_token, bos_token = "<pad>", "<eos>", "<bos>"
    add_bos = True
    eos_ids = (1,)
    supports_fim = False
    fim_end_ids: tuple[int, ...] = ()
    chat_template: str | None = None

    def encode_infill(self, prefix: str, suffix: str) -> list[int]:
        raise ValueError("no fill-in-the-middle tokens")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [NUM_SPECIAL + b for b in text.encode("utf-8")]
        return [self.bos_id, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        out, pending = [], bytearray()
        for i in ids:
            if i >= NUM_SPECIAL:
                pending.append(i - NUM_SPECIAL)
                continue
            out.append(pending.decode("utf-8", errors="replace"))
            pending = bytearray()
            if not skip_special_tokens:
                out.append(SPECIAL[i])
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def id_to_token(self, token_id: int) -> str:
        return self.decode([token_id])  # a byte's token alone: its text where it is a whole character


def tiny_config(vocab_size: int = ByteTokenizer.vocab_size) -> ModelConfig:
    return ModelConfig(
        architecture="gemma3",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_layers=6,
        num_heads=4,
        num_kv_heads=1,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        rope_local_theta=1e4,
        max_position_embeddings=512,
        sliding_window=8,
        layer_types=("sliding_attention",) * 5 + ("full_attention",),
        query_pre_attn_scalar=16,
    )


def tiny_model(seed: int = 0) -> Gemma3ForCausalLM:
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(tiny_config())
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.eval()


def tiny_core(**overrides: object) -> EngineCore:
    config = Config(
        **{
            "dtype": "float32",
            "block_size": 4,
            "num_kv_blocks": 256,
            "max_num_seqs": 16,
            "max_num_batched_tokens": 64,
            **overrides,
        }
    )  # type: ignore[arg-type]
    return build_engine_core(tiny_model(), ByteTokenizer(), config)  # type: ignore[arg-type]


class FixedCost(StepCost):
    """A step cost that never learns: its fixed part is the prior, whatever the steps took."""

    def fixed_rows(self, rows: int) -> float:
        return self.prior_rows

    def seconds_at(self, rows: int) -> float | None:
        return None  # the fixed part alone prices a step (speculation.plan)


def drafting_core(**overrides: object) -> EngineCore:
    """tiny_core whose drafts are sized as if a step's rows cost nothing: which drafts it makes does not hang on how
    fast this machine ran its steps (speculation.StepCost)."""
    core = tiny_core(**overrides)
    core.step_cost = FixedCost(MAX_FIXED_ROWS)
    return core


TOK = ByteTokenizer()


def run_all(core: EngineCore, max_steps: int = 2000) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        for out in core.step():
            outputs.setdefault(out.request_id, []).append(out)
        if not core.has_work:
            return outputs
    raise AssertionError("engine did not finish")


def choice_tokens(outs: list[RequestOutput], index: int = 0) -> list[int]:
    return [t for o in outs for d in o.deltas if d.index == index for t in d.token_ids]


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logit_bias={TOK.eos_id: -100.0}, **kw)  # type: ignore[arg-type]


def poison_hidden(core: EngineCore, is_bad: Callable[[Sequence], bool]) -> None:
    """Every forward pass writes NaN into the hidden states of the rows of sequences that `is_bad` picks."""
    forward = core.runner.forward

    def poisoned(batch: list[Scheduled], greedy_keep: list[int] | None = None) -> torch.Tensor:
        hidden = forward(batch, greedy_keep)
        row = 0
        with torch.inference_mode():
            for s in batch:
                if is_bad(s.seq):
                    hidden[row : row + s.num_tokens] = float("nan")
                    core.runner.head = None  # a head found in the forward's call saw the rows unpoisoned
                row += s.num_tokens
        return hidden

    core.runner.forward = poisoned  # type: ignore[method-assign]
