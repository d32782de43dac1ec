"""A tiny random-weight Gemma 3 and a byte-level tokenizer: the engine's fast tests need no files at all."""

from __future__ import annotations

import torch

from tokenmill.config import Config
from tokenmill.engine.core import EngineCore
from tokenmill.engine.engine import build_engine_core
from tokenmill.model.gemma3 import Gemma3ForCausalLM
from tokenmill.model.model_config import ModelConfig

NUM_SPECIAL = 4  # 0 <pad>, 1 <eos>, 2 <bos>, 3 <unk>; then one token per byte
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]


class ByteTokenizer:
    """Token id 4 + b for byte b: multi-byte characters span tokens, as byte-fallback pieces do."""

    vocab_size = NUM_SPECIAL + 256
    pad_id, eos_id, bos_id = 0, 1, 2
    pad_token, eos_token, bos_token = "<pad>", "<eos>", "<bos>"
    add_bos = True
    eos_ids = (1,)

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
