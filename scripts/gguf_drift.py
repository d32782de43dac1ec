"""Scoring drift per GGUF quantisation type: tokenmill's next to llama.cpp's own, each against its float32 run.

python scripts/gguf_drift.py          # the default model's weights; minutes (llama.cpp's tools are built once)

The default file's weights are written as one F32 GGUF (llama-quantize --allow-requantize, exact: dequantising
is exact in float32) and quantised from it to each type by llama.cpp's own quantiser, so every file holds the same
weights. For each file, both engines score the same text the way llama.cpp's `llama-perplexity --kl-divergence`
does: chunks of N_CTX tokens, each starting with BOS, every position of a chunk's second half scored. Each engine's
drift is against its own float32 run of the F32 file: mean KL divergence of the next-token distributions (float32
base ‖ quantised) and how often both pick the same top token. tokenmill runs its default for a GGUF: the file's own
blocks (gguf_matmul.c) with bfloat16 activations.
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import torch

from tokenmill.bench.llama_server import binary_path, ensure_llama_server
from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.linear import prepare_linears
from tokenmill.model.loading.loader import load_model_files, packaged_gguf
from tokenmill.model.registry import build_model

ROOT = Path(__file__).resolve().parents[1]
TYPES = ("Q4_0", "Q5_0", "Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K")  # every block type (the K-mixes fall back to Q5_0/Q8_0)
N_CTX, CHUNKS = 512, 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=ROOT / ".bench" / "drift", help="files and logs go here")
    parser.add_argument("--types", nargs="+", default=list(TYPES))
    args = parser.parse_args()
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    tools = ROOT / ".bench" / "llama-server-11434.0.0"
    ensure_llama_server(tools)
    text = work / "text.txt"
    text.write_text((ROOT / "README.md").read_text() + (ROOT / "docs" / "architecture.md").read_text())
    f32 = work / "gemma3-270m-F32.gguf"
    if not f32.is_file():
        quantize(tools, packaged_gguf(work / "cache"), f32, "F32")
    base = work / "llama-f32.kld"
    perplexity(tools, f32, text, ["--kl-divergence-base", str(base)], work / "llama-f32.log")
    ids = chunks(f32, text, work)
    reference = log_probs(f32, ids, work, torch.float32, "none")
    print(
        f"{'type':8} {'file MB':>8} {'tokenmill KLD':>14} {'llama.cpp KLD':>14} {'tokenmill same top':>19} "
        f"{'llama.cpp same top':>19}   ({len(ids) * (N_CTX - 1 - N_CTX // 2)} positions)"
    )
    for kind in args.types:
        file = work / f"gemma3-270m-{kind}.gguf"
        if not file.is_file():
            quantize(tools, f32, file, kind)
        log = work / f"llama-{kind}.log"
        out = perplexity(tools, file, text, ["--kl-divergence-base", str(base), "--kl-divergence"], log)
        llama_kld = float(re.search(r"Mean\s+KLD:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
        llama_top = float(re.search(r"Same top p:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
        ours = log_probs(file, ids, work, torch.bfloat16, "gguf")
        kld = (reference.exp() * (reference - ours)).sum(-1).mean().item()
        same = (reference.argmax(-1) == ours.argmax(-1)).float().mean().item() * 100
        print(
            f"{kind:8} {file.stat().st_size / 1e6:8.0f} {kld:14.6f} {llama_kld:14.6f} {same:18.2f}% {llama_top:18.2f}%",
            flush=True,
        )


def quantize(tools: Path, source: Path, target: Path, kind: str) -> None:
    command = [str(binary_path(tools, "llama-quantize")), "--allow-requantize", str(source), str(target), kind]
    subprocess.run(command, check=True, capture_output=True)


def perplexity(tools: Path, model: Path, text: Path, extra: list[str], log: Path) -> str:
    command = [str(binary_path(tools, "llama-perplexity")), "-m", str(model), "-f", str(text)]
    command += ["-c", str(N_CTX), "--chunks", str(CHUNKS), "-t", str(torch.get_num_threads()), *extra]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    log.write_text(done.stdout + done.stderr)
    return done.stdout + done.stderr


def chunks(model: Path, text: Path, work: Path) -> list[torch.Tensor]:
    """The text's tokens as llama-perplexity cuts them: N_CTX at a time, each chunk's first token replaced by BOS."""
    tokenizer = load_model_files(str(model), str(work / "cache"), torch.bfloat16, "gguf").tokenizer
    tokens = tokenizer.encode(text.read_text())  # with BOS first, as llama.cpp tokenizes it
    assert tokenizer.bos_id is not None and len(tokens) >= CHUNKS * N_CTX, "the text is too short"
    out = []
    for i in range(CHUNKS):
        chunk = torch.tensor(tokens[i * N_CTX : (i + 1) * N_CTX])
        chunk[0] = tokenizer.bos_id
        out.append(chunk)
    return out


def log_probs(model: Path, ids: list[torch.Tensor], work: Path, dtype: torch.dtype, quant: str) -> torch.Tensor:
    """log softmax of the next-token logits at every scored position, (positions, vocab) float32."""
    loaded = load_model_files(str(model), str(work / "cache"), dtype, quant)
    net: CausalLM = build_model(loaded.config, loaded.state_dict, quantized=loaded.quantized)
    prepare_linears(net, quant)
    rows = [torch.log_softmax(net.forward_dense(chunk)[N_CTX // 2 : N_CTX - 1].float(), -1) for chunk in ids]
    return torch.cat(rows)


if __name__ == "__main__":
    main()
