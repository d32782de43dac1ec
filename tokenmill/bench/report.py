"""The readable table (one column per system, then tokenmill ÷ each other system), the JSON file, and the progress
lines a run prints as it goes."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Figures = dict[str, float | None]
RATIO_NOTE = "ratios are the first system ÷ the other: above 1 is better for tok/s, below 1 for times and memory."
HF_NOTE = (
    "hf-bf16/hf-fp32: Hugging Face transformers generate() in-process, no HTTP: its 'N clients: aggregate' is one "
    "batch-N generate() and its TTFT is prefill + one token."
)


def rows(concurrency: Sequence[int], prefill: Sequence[int] = ()) -> list[tuple[str, str, str]]:
    """(figure key, label, unit) in the order the table prints them."""
    table = [
        ("decode_tok_s", "single-stream decode", "tok/s"),
        ("bandwidth_share", "single-stream: share of bandwidth limit", "%"),
        ("weights_read_mb", "weights read per token", "MB"),
        ("ttft_s", "single-stream TTFT", "ms"),
    ]
    table += [(f"prefill{n}_tok_s", f"prefill, {n:,}-token prompt", "tok/s") for n in prefill]
    for c in concurrency:
        clients = f"{c} client" + ("s" if c != 1 else "")
        table += [
            (f"c{c}_agg_tok_s", f"{clients}: aggregate", "tok/s"),
            (f"c{c}_latency_p50_s", f"{clients}: latency p50", "s"),
            (f"c{c}_latency_p99_s", f"{clients}: latency p99", "s"),
            (f"c{c}_ttft_p50_s", f"{clients}: TTFT p50", "ms"),
            (f"c{c}_ttft_p99_s", f"{clients}: TTFT p99", "ms"),
        ]
    table += [
        ("peak_rss_mb", "peak RSS", "MB"),
        ("startup_first_s", "start-up, empty cache", "s"),
        ("startup_s", "start-up, cached", "s"),
    ]
    return table


def ratios(systems: dict[str, Figures]) -> dict[str, Figures]:
    """first system's figure ÷ each other system's, per figure both have."""
    names = list(systems)
    if len(names) < 2:
        return {}
    first = systems[names[0]]
    out: dict[str, Figures] = {}
    for other in names[1:]:
        out[f"{names[0]}/{other}"] = {
            key: (value / theirs if value is not None and theirs else None)
            for key, value in first.items()
            if (theirs := systems[other].get(key)) is not None
        }
    return out


def bandwidth_line(meta: dict[str, Any]) -> str:
    """What the bandwidth limit is made of: the measured read speed and the file's weight bytes."""
    low, high = meta.get("memory_read_gb_s_range") or (meta["memory_read_gb_s"],) * 2
    return (
        f"memory read {meta['memory_read_gb_s']:.1f} GB/s, {low:.1f}–{high:.1f} (a float32 sum over 1 GiB"
        f"{' in huge pages' if meta.get('memory_read_pages') == 'huge' else ''} on every "
        f"core, best of 5, just before and after each single-stream run; each share is against the bandwidth "
        f"around its own run); weights a step reads {meta['weight_bytes'] / 1e6:.0f} MB: single-stream limit at the "
        f"median {meta['bandwidth_limit_tok_s']:.1f} tok/s, each weight read once per token"
    )


def format_value(value: float | None, unit: str) -> str:
    if value is None:
        return "–"
    if unit == "ms":
        return f"{value * 1000:.0f}"
    if unit == "%":
        return f"{value * 100:.0f}%"
    if unit == "s":
        return f"{value:.2f}"
    return f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def format_table(systems: dict[str, Figures], concurrency: Sequence[int], prefill: Sequence[int] = ()) -> str:
    ratio_table = ratios(systems)
    header = ["figure", "unit", *systems, *ratio_table]
    body = []
    for key, label, unit in rows(concurrency, prefill):
        if all(figures.get(key) is None for figures in systems.values()):
            continue
        cells = [format_value(figures.get(key), unit) for figures in systems.values()]
        cells += [_ratio(r.get(key)) for r in ratio_table.values()]
        body.append([label, unit, *cells])
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in [header, *body]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def notes_for(systems: dict[str, Figures]) -> list[str]:
    return ([RATIO_NOTE] if len(systems) > 1 else []) + ([HF_NOTE] if any(n.startswith("hf-") for n in systems) else [])


def write_json(path: str | Path, results: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(results, indent=1, default=str) + "\n")


def workload_lines(workload: dict[str, Any]) -> str:
    """A --workload run's own findings: whether the speculating tokenmill answered as the other, and how many of its
    draft tokens were kept."""
    agreement, spec = workload["agreement"], workload["speculation"]
    lines = [
        f"workload {workload['name']}: {workload['prompts']} prompts"
        + (f" built from {', '.join(workload['sources'])}" if workload["sources"] else ""),
        (
            f"tokenmill with and without --speculative {workload['speculative']}: {agreement['identical']} of "
            f"{agreement['compared']} answers identical"
        ),
    ]
    if spec.get("acceptance") is not None:
        lines.append(
            f"drafts: {spec['spec_drafts']}, draft tokens {spec['spec_draft_tokens']}, kept "
            f"{spec['spec_accepted_tokens']} ({spec['acceptance']:.0%})"
        )
    if workload.get("llama_lookup_args"):
        lines.append(f"llama-server+lookup: {workload['llama_lookup_args']}")
    return "\n".join(lines)


def lora_lines(lora: dict[str, Any]) -> str:
    """A --lora run's setting: how many adapters, of which rank, over what."""
    return (
        f"{lora['adapters']} random LoRA adapters of rank {lora['rank']}, over {lora['targets']}; request i takes "
        f"adapter i modulo {lora['adapters']} (the single stream: the first)"
    )


def progress(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
