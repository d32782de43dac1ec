"""`tokenmill bench --lora N`: serving LoRA adapters, side by side with serving none.

N random adapters of rank --lora-rank over every linear of every layer (lora.py) are served by tokenmill (`--lora`, a
request's `model` picks one) and, with --compare, by llama-server (`--lora` with `--lora-init-without-apply`, a
request's `lora` list picks one), the same update as GGUF LoRA files. Each system also runs without adapters. The
load is the standard run's: the single stream (every request with the first adapter), then each concurrency level,
request i with adapter i modulo N, so that 16 clients over 4 adapters keep every adapter busy at once. Passes run in
turn one way and then back, each on a server started for it (workload_run.py says why). tokenmill runs with
speculation off, as in the standard run: the figures are the decode step's.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import tempfile
from pathlib import Path
from typing import Any

from tokenmill.bench import load
from tokenmill.bench.llama_server import ensure_llama_server, llama_server_spec
from tokenmill.bench.load import LoadSettings
from tokenmill.bench.lora import write_gguf_lora, write_random_adapter
from tokenmill.bench.servers import ServerSpec, free_port, tokenmill_spec
from tokenmill.bench.workload_run import in_turn
from tokenmill.model.loading.gguf_convert import gguf_config
from tokenmill.model.loading.gguf_file import read_gguf_file

DEFAULT_CONCURRENCY = (16,)


@dataclasses.dataclass(frozen=True)
class System:
    spec: ServerSpec
    variants: tuple[dict[str, Any], ...]  # what request i adds to its body (the i-th modulo their number)


def adapters_for(model_file: str, count: int, rank: int, directory: Path) -> tuple[list[Path], list[Path]]:
    """`count` random adapters of the model: their PEFT directories and the same as GGUF LoRA files."""
    config = gguf_config(*read_gguf_file(model_file))
    peft = [write_random_adapter(directory / f"adapter{i}", config, rank, seed=i) for i in range(count)]
    gguf = [write_gguf_lora(directory / f"adapter{i}.gguf", path, config) for i, path in enumerate(peft)]
    return peft, gguf


def systems_for(args: argparse.Namespace, model_file: str, peft: list[Path], gguf: list[Path]) -> list[System]:
    """tokenmill with the adapters first (the ratios divide its figures), then without; llama-server likewise."""
    extra = [*shlex.split(args.tokenmill_args), "--speculative", "off"]
    loras = [arg for i, path in enumerate(peft) for arg in ("--lora", f"adapter{i}={path}")]
    with_adapters = tokenmill_spec(free_port(), model_file, [*extra, *loras], args.cache_dir)
    systems = [
        System(dataclasses.replace(with_adapters, name="tokenmill+lora"), _models(len(peft))),
        System(tokenmill_spec(free_port(), model_file, extra, args.cache_dir), ()),
    ]
    if args.compare:
        binary = str(ensure_llama_server(args.llama_server_dir, args.llama_server_version))
        peer_extra = shlex.split(args.llama_server_args)
        files = ["--lora", ",".join(str(path) for path in gguf), "--lora-init-without-apply"]
        slots, ctx, threads = args.llama_server_slots, args.llama_server_ctx, args.peer_threads
        peer = llama_server_spec(binary, free_port(), model_file, threads, slots, ctx, [*peer_extra, *files])
        systems += [
            System(dataclasses.replace(peer, name="llama-server+lora"), _lora_lists(len(gguf))),
            System(llama_server_spec(binary, free_port(), model_file, threads, slots, ctx, peer_extra), ()),
        ]
    return systems


def _models(count: int) -> tuple[dict[str, Any], ...]:
    return tuple({"model": f"adapter{i}"} for i in range(count))


def _lora_lists(count: int) -> tuple[dict[str, Any], ...]:
    return tuple({"lora": [{"id": i, "scale": 1.0}]} for i in range(count))


def lora_settings(args: argparse.Namespace, settings: LoadSettings) -> LoadSettings:
    """The standard prompts and single stream; the concurrency levels asked for (default: 16); no prefill timings."""
    concurrency = tuple(args.concurrency or DEFAULT_CONCURRENCY)
    return dataclasses.replace(settings, concurrency=concurrency, prefill_tokens=())


def run_lora(
    args: argparse.Namespace, model_file: str, settings: LoadSettings, rounds: int, start_timeout: float
) -> dict[str, Any]:
    """The rounds, each pass on a server started for it; each system's passes."""
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-") as tmp:
        peft, gguf = adapters_for(model_file, args.lora, args.lora_rank, Path(tmp) / "adapters")
        systems = systems_for(args, model_file, peft, gguf)
        results: dict[str, dict[str, Any]] = {s.spec.name: {"passes": [], "peak_rss_mb": None} for s in systems}
        variants = {s.spec.name: s.variants for s in systems}
        what = f", {args.lora} adapters of rank {args.lora_rank}"
        for spec, server in in_turn([s.spec for s in systems], rounds, start_timeout, Path(tmp), results, what):
            if settings.eos_ids is None:
                settings = dataclasses.replace(settings, eos_ids=load.served_eos_ids(server.url, settings))
            own = dataclasses.replace(settings, variants=variants[spec.name])
            results[spec.name]["passes"].append(load.run(load.bench_url(server.url, own)))
    return {"settings": settings, "systems": results}
