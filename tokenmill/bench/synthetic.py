"""Random-weight GGUF files of published model shapes, for benchmarking at real sizes without downloading a model.

Speed on a CPU depends on a model's shape and its file's quantisation, not on what its weights say, so a file with
random weights of Gemma 3 1B's or Llama 3.2 1B's shape measures what the real one would. The tokenizer and every other
metadata key come from a real file of the family (Gemma: the packaged Gemma 3 270M; Llama 3: the vocabulary file
llama.cpp's sources carry for its tokenizer tests, `models/ggml-vocab-llama-bpe.gguf`, written by its converter from
Meta's Llama 3 tokenizer), the shape keys from the published config; weights are written as F16 and then quantised by
llama.cpp's own quantiser (`llama-quantize`, built with the bench's llama-server), so tokenmill and the llama.cpp peers
load the identical file, quantised exactly as llama.cpp users' files are.
"""

from __future__ import annotations

import math
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenmill.bench.servers import cpu_cores

WEIGHT_STD = 0.02  # typical initialisation scale: activations stay finite through every layer
QUANT_TYPE = "Q4_K_M"


@dataclass(frozen=True)
class Llama3Rope:
    """Llama 3.1+'s rope scaling (config.json's rope_scaling), which llama.cpp's converter writes as a tensor."""

    theta: float
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_context: int


@dataclass(frozen=True)
class Shape:
    architecture: str
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int
    sliding_window: int | None
    llama3_rope: Llama3Rope | None = None
    # where the tokenizer and metadata come from: None, the packaged Gemma file; else a file in llama.cpp's sources
    source: str | None = None


LLAMA_VOCAB = "models/ggml-vocab-llama-bpe.gguf"

# Published configurations (the model cards' config.json), reduced to what the file's shape keys hold. Both tie the
# LM head to the embedding, as the real 1B files do.
SHAPES = {
    "gemma3-1b": Shape("gemma3", 1152, 26, 6912, 4, 1, 256, 32768, 512),
    "llama3.2-1b": Shape(
        "llama", 2048, 16, 8192, 32, 8, 64, 131072, None, Llama3Rope(500_000.0, 32.0, 1.0, 4.0, 8192), LLAMA_VOCAB
    ),
}


def synthetic_path(directory: Path, name: str) -> Path:
    return directory / f"{name}-random-{QUANT_TYPE}.gguf"


def ensure_synthetic(name: str, directory: Path, quantize: Path, source: Path, seed: int = 0) -> Path:
    """The random-weight `name` file under `directory`, written and quantised first if missing."""
    target = synthetic_path(directory, name)
    if target.is_file():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    f16 = directory / f"{name}-random-F16.gguf"
    print(f"writing {f16} (random weights, {name}'s shape; metadata and tokenizer from {source.name})", flush=True)
    write_f16(SHAPES[name], source, f16, seed)
    tmp = target.with_suffix(".tmp")
    print(f"quantising to {QUANT_TYPE} with {quantize}", flush=True)
    with (directory / "quantize.log").open("ab") as log:
        command = [str(quantize), str(f16), str(tmp), QUANT_TYPE, str(cpu_cores())]
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=True)
    tmp.replace(target)
    f16.unlink()
    return target


def write_f16(shape: Shape, source: Path, path: Path, seed: int = 0) -> None:
    """`shape` with random F16 weights (F32 norms) and `source`'s metadata, its shape keys replaced."""
    import gguf

    reader = gguf.GGUFReader(source)
    if str(reader.fields["general.architecture"].contents()) != shape.architecture:
        raise ValueError(f"{source} is not a {shape.architecture} file")
    writer = gguf.GGUFWriter(str(path), shape.architecture)
    shape_keys = _shape_keys(shape, reader.fields)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or field.name in shape_keys:
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for key, value in shape_keys.items():
        writer.add_key_value(key, value, gguf.GGUFValueType.UINT32)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)  # one embedding row per token (a vocab file has no rows)
    rng = np.random.default_rng(seed)
    for name, rows_cols in tensor_shapes(shape, vocab):
        writer.add_tensor(name, _random(rng, name, rows_cols))
    if shape.llama3_rope is not None:
        writer.add_tensor("rope_freqs.weight", llama3_rope_divisors(shape.llama3_rope, shape.head_dim))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tensor_shapes(shape: Shape, vocab: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape: rows = outputs) of every weight a Gemma 3 or Llama file of `shape` holds (tied head: no
    output tensor). Gemma has a norm after each sublayer and on each q and k head; Llama one norm before each."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    gemma = shape.architecture == "gemma3"
    yield "token_embd.weight", (vocab, h)
    yield "output_norm.weight", (h,)
    for i in range(shape.layers):
        b = f"blk.{i}."
        yield b + "attn_q.weight", (q, h)
        yield b + "attn_k.weight", (kv, h)
        yield b + "attn_v.weight", (kv, h)
        yield b + "attn_output.weight", (h, q)
        yield b + "ffn_gate.weight", (shape.ffn, h)
        yield b + "ffn_up.weight", (shape.ffn, h)
        yield b + "ffn_down.weight", (h, shape.ffn)
        norms = (
            ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm") if gemma else ("attn_norm", "ffn_norm")
        )
        for norm in norms:
            yield b + f"{norm}.weight", (h,)
        if gemma:
            yield b + "attn_q_norm.weight", (shape.head_dim,)
            yield b + "attn_k_norm.weight", (shape.head_dim,)


def llama3_rope_divisors(rope: Llama3Rope, head_dim: int) -> np.ndarray:
    """One divisor per rotary frequency, as llama.cpp's converter computes them (LlamaModel.generate_extra_tensors):
    short wavelengths kept, long ones divided by `factor`, the band between blended."""
    divisors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * rope.theta ** (i / head_dim)
        if wavelength < rope.original_context / rope.high_freq_factor:
            divisors.append(1.0)
        elif wavelength > rope.original_context / rope.low_freq_factor:
            divisors.append(rope.factor)
        else:
            smooth = (rope.original_context / wavelength - rope.low_freq_factor) / (
                rope.high_freq_factor - rope.low_freq_factor
            )
            divisors.append(1 / ((1 - smooth) / rope.factor + smooth))
    return np.array(divisors, dtype=np.float32)


def _shape_keys(shape: Shape, source_fields: Mapping[str, object]) -> dict[str, int]:
    """The shape's keys, and the rotary width where the source file states one (llama.cpp's Llama files do)."""
    arch = shape.architecture
    keys = {
        f"{arch}.embedding_length": shape.hidden,
        f"{arch}.block_count": shape.layers,
        f"{arch}.feed_forward_length": shape.ffn,
        f"{arch}.attention.head_count": shape.heads,
        f"{arch}.attention.head_count_kv": shape.kv_heads,
        f"{arch}.attention.key_length": shape.head_dim,
        f"{arch}.attention.value_length": shape.head_dim,
        f"{arch}.context_length": shape.context,
    }
    if shape.sliding_window is not None:
        keys[f"{arch}.attention.sliding_window"] = shape.sliding_window
    if f"{arch}.rope.dimension_count" in source_fields:
        keys[f"{arch}.rope.dimension_count"] = shape.head_dim
    return keys


def _random(rng: np.random.Generator, name: str, rows_cols: tuple[int, ...]) -> np.ndarray:
    if len(rows_cols) == 1:  # norms of 1 leave activations unscaled (llama.cpp stores Gemma's 1 + w as it is)
        return np.ones(rows_cols, dtype=np.float32)
    return (rng.standard_normal(rows_cols, dtype=np.float32) * WEIGHT_STD).astype(np.float16)
