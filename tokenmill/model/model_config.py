"""ModelConfig: the shape of a decoder-only transformer, read from GGUF metadata or a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_ARCHITECTURES = ("gemma3", "llama")


class UnsupportedModelError(ValueError):
    """The file describes an architecture this engine has no implementation for."""


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
    rms_norm_eps: float
    rope_theta: float  # global (full-attention) layers
    max_position_embeddings: int
    tie_word_embeddings: bool = True
    rope_local_theta: float | None = None  # Gemma 3 sliding-window layers use their own base
    rope_scaling_factor: float = 1.0  # linear position scaling of the global layers (1.0: none)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # "sliding_attention" | "full_attention" per layer; empty: all full
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5; None: head_dim ** -0.5
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
