"""ModelConfig: the shape of a decoder-only transformer, read from GGUF metadata or a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass

# GGUF's `general.architecture` names (Mistral files say "llama"); config.json's model_type maps onto them (hf_dir.py)
SUPPORTED_ARCHITECTURES = ("gemma3", "gemma2", "llama", "qwen2", "qwen3", "phi3", "starcoder2")


class UnsupportedModelError(ValueError):
    """The file describes an architecture this engine has no implementation for."""


@dataclass(frozen=True)
class RopeScaling:
    """Per-frequency rotary scaling: frequency i is divided by `divisors[i]` (head_dim / 2 of them).

    Llama 3's scaling and a GGUF's `rope_freqs` tensor are such divisors. Phi-3's longrope has two sets: `divisors`
    (its short factors) for positions below `original_max_positions` and `long_divisors` from there on, chosen per
    token by its own position, so a token's rotation never depends on its neighbours (the batch, or how long the
    sequence will grow). Hugging Face picks one set for a whole forward by its longest sequence; the two agree on every
    sequence shorter than `original_max_positions`. cos and sin are then multiplied by `attention_scale`.
    """

    divisors: tuple[float, ...]
    long_divisors: tuple[float, ...] | None = None
    original_max_positions: int | None = None
    attention_scale: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float  # the norms' epsilon (StarCoder2's are layer norms)
    rope_theta: float  # global (full-attention) layers
    max_position_embeddings: int
    tie_word_embeddings: bool = True
    rope_local_theta: float | None = None  # Gemma 3 sliding-window layers use their own base
    rope_scaling_factor: float = 1.0  # linear position scaling of the global layers (1.0: none)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # "sliding_attention" | "full_attention" per layer; empty: all full
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5; None: head_dim ** -0.5
    attention_bias: bool = False  # q/k/v projections have biases (Qwen2; Llama and Qwen3 configs may say so)
    output_bias: bool = False  # the attention's output projection has one (Llama / Qwen3 with attention_bias)
    mlp_bias: bool = False  # gate/up/down have biases (Llama's mlp_bias)
    qk_norm: bool = False  # each q and k head RMS-normed before the rotary (Qwen3)
    rope: RopeScaling | None = None  # frequency scaling beyond linear (Llama 3, Phi-3's longrope)
    attn_logit_softcapping: float | None = None  # Gemma 2: scores become cap * tanh(score / cap)
    final_logit_softcapping: float | None = None  # Gemma 2: logits likewise
    name: str = ""

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported model architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5
