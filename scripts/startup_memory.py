"""Peak memory (RSS) of a tokenmill start, from process start to a loaded engine, per model.

python scripts/startup_memory.py                     # the packaged default, and a 1B-class Hugging Face directory
python scripts/startup_memory.py --shape llama3-8b   # ... and an 8B one (16 GB of bf16 safetensors written once)
python scripts/startup_memory.py --model PATH ...    # any models (GGUF files, HF directories); 'default' = packaged

Each model is loaded by `tokenmill models --model X` in a fresh process (what `serve` does before it listens: load,
convert, build the engine, size the KV cache) and its peak RSS read from the kernel's own account (wait4's ru_maxrss),
so nothing samples and nothing is missed. Without --model it also writes, once, random-weight Hugging Face directories
of published shapes (--shape, repeatable: gemma3-1b by default, llama3-8b) in bfloat16 under --dir, each with the
packaged Gemma 3 file's tokenizer: the 8B directory's tokenizer is not its family's, which a load does not notice but
a prompt could (ids past Llama 3's 128,256 rows), so it is for measuring a start, not for serving.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Gemma 3 1B's config.json (the published model card), the fields tokenmill reads
GEMMA3_1B = {
    "model_type": "gemma3_text",
    "architectures": ["Gemma3ForCausalLM"],
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "num_hidden_layers": 26,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "vocab_size": 262144,
    "max_position_embeddings": 32768,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 2,
    "eos_token_id": [1, 106],
    "pad_token_id": 0,
}
# Llama 3.1 8B's config.json (the published model card)
LLAMA3_8B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500_000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 2,
    "eos_token_id": [1, 106],
}
SHAPES = {"gemma3-1b": GEMMA3_1B, "llama3-8b": LLAMA3_8B}
LAYERS_PER_SHARD = 6


def write_hf_dir(c: dict, directory: Path, seed: int = 0) -> Path:
    """Random bf16 weights of config `c` (std 0.02; unit norms: Gemma scales by 1 + w, so zeros there), sharded as
    checkpoints are."""
    import torch
    from safetensors.torch import save_file

    from tokenmill.model.loading.gguf_convert import read_gguf_tokenizer
    from tokenmill.model.loading.loader import packaged_gguf

    if (directory / "config.json").is_file():
        return directory
    tmp = directory.with_name(directory.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    gemma = c["model_type"].startswith("gemma")
    h, ffn, head = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * head, c["num_key_value_heads"] * head
    generator = torch.Generator().manual_seed(seed)

    def random(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    def norm(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.bfloat16) if gemma else torch.ones(n, dtype=torch.bfloat16)

    layers = c["num_hidden_layers"]
    shards = [range(i, min(i + LAYERS_PER_SHARD, layers)) for i in range(0, layers, LAYERS_PER_SHARD)]
    index: dict[str, str] = {}
    for number, shard in enumerate(shards):
        tensors = {"model.embed_tokens.weight": random(c["vocab_size"], h), "model.norm.weight": norm(h)}
        tensors = tensors if number == 0 else {}
        if number == len(shards) - 1 and not c["tie_word_embeddings"]:
            tensors["lm_head.weight"] = random(c["vocab_size"], h)
        for i in shard:
            p = f"model.layers.{i}."
            tensors |= {
                p + "self_attn.q_proj.weight": random(q, h),
                p + "self_attn.k_proj.weight": random(kv, h),
                p + "self_attn.v_proj.weight": random(kv, h),
                p + "self_attn.o_proj.weight": random(h, q),
                p + "mlp.gate_proj.weight": random(ffn, h),
                p + "mlp.up_proj.weight": random(ffn, h),
                p + "mlp.down_proj.weight": random(h, ffn),
            }
            if gemma:
                tensors |= {p + "self_attn.q_norm.weight": norm(head), p + "self_attn.k_norm.weight": norm(head)}
            for kind in ("input", "post_attention") + (("pre_feedforward", "post_feedforward") if gemma else ()):
                tensors[p + f"{kind}_layernorm.weight"] = norm(h)
        name = f"model-{number + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        index |= dict.fromkeys(tensors, name)
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))
    (tmp / "config.json").write_text(json.dumps(c, indent=1))
    tokenizer = read_gguf_tokenizer(str(packaged_gguf(Path(tempfile.mkdtemp()))))
    tokenizer.save(tmp)  # tokenizer.json (and tokenmill's own settings file, which a HF directory ignores)
    special = tokenizer.special
    settings = {"bos_token": special.bos_token, "eos_token": special.eos_token, "pad_token": special.pad_token}
    settings |= {"add_bos_token": special.add_bos, "add_eos_token": special.add_eos}
    (tmp / "tokenizer_config.json").write_text(json.dumps(settings, indent=1))
    tmp.rename(directory)
    return directory


# Linux carries a process's peak RSS across fork and exec (ru_maxrss starts at the forking process's size), so the
# model's process is forked from a fresh, small interpreter, which reports that child's own peak from wait4.
_LAUNCHER = """
import os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
print(usage.ru_maxrss, os.waitstatus_to_exitcode(status))
"""


def peak_rss_mb(model: str, extra: list[str]) -> tuple[float, float]:
    """(peak RSS in MiB, seconds) of `tokenmill models` loading `model` in a fresh process."""
    argv = [sys.executable, "-m", "tokenmill.cli", "models", *([] if model == "default" else ["--model", model])]
    start = time.monotonic()
    with tempfile.TemporaryFile() as log:
        done = subprocess.run(
            [sys.executable, "-c", _LAUNCHER, *argv, *extra],
            check=False,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            timeout=1800,
        )
        lines = done.stdout.split("\n")
        max_rss_kib, code = (int(word) for word in lines[-2].split())  # the launcher's line, after the command's
        if code != 0:
            log.seek(0)
            raise SystemExit(f"loading {model} failed:\n{log.read().decode(errors='replace')[-3000:]}")
    return max_rss_kib / 1024, time.monotonic() - start  # ru_maxrss is in KiB on Linux


def weights_mb(model: str) -> float:
    path = Path(model)
    if path.is_dir():
        return sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20
    return path.stat().st_size / 2**20 if path.is_file() else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", help="a model to load (repeatable); 'default': the packaged one")
    parser.add_argument("--shape", action="append", choices=SHAPES, help="shapes to write and load (repeatable)")
    parser.add_argument("--dir", type=Path, default=ROOT / ".bench" / "synthetic", help="where the directories go")
    parser.add_argument("--tokenmill-args", default="", help="flags for every start, e.g. '--quantization int4'")
    args = parser.parse_args()
    shapes = args.shape or ["gemma3-1b"]
    models = args.model or ["default"] + [
        str(write_hf_dir(SHAPES[n], args.dir / f"{n}-random-bf16-hf")) for n in shapes
    ]
    print("| model | files on disk | peak RSS at start-up | load time |")
    print("|---|---|---|---|")
    for model in models:
        rss, seconds = peak_rss_mb(model, args.tokenmill_args.split())
        size = "packaged GGUF" if model == "default" else f"{weights_mb(model):,.0f} MiB"
        print(f"| {Path(model).name} | {size} | {rss:,.0f} MiB | {seconds:.1f} s |", flush=True)


if __name__ == "__main__":
    main()
