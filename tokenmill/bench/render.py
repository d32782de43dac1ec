"""`python -m tokenmill.bench.render`: docs/performance.md, rendered from the bench runs committed in docs/bench/.

    tokenmill bench --compare --peers llama-server ik-llama-server --rounds 2 --json docs/bench/
    python -m tokenmill.bench.render                      # reads docs/bench/*.json, writes docs/performance.md
    python -m tokenmill.bench.render --bench-dir DIR --out FILE --readme README.md

`--json` given a folder names the file after the machine's kind and the model, so a new run on the same kind of
machine replaces the last one's file (git keeps the old figures). The page is one section per machine kind, one table
per model in it, each with the exact command and date of its run; nothing on it is typed by hand, and a test checks
that the committed page is what this module makes of the committed JSON. The README's short table (between its
`<!-- figures:begin -->` and `<!-- figures:end -->` lines) is rendered from the same runs: the headline ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenmill.bench.report import format_value, lora_lines, ratios, rows, workload_lines

BENCH_DIR = Path("docs") / "bench"
PAGE = Path("docs") / "performance.md"
README = Path("README.md")
BEGIN, END = "<!-- figures:begin -->", "<!-- figures:end -->"
# the README's headline figures: (figure key, column heading); the concurrent ones at the run's largest level
HEADLINE = (
    ("decode_tok_s", "single stream", "tok/s"),
    ("agg_tok_s", "{c} clients", "tok/s"),
    ("ttft_p50_s", "TTFT p50, {c} clients", "ms"),
)
INTRO = """\
# Performance

<!-- Rendered by `python -m tokenmill.bench.render` from docs/bench/*.json: change those, not this page. -->

Each table is one `tokenmill bench --compare` run. tokenmill and each peer serve the same GGUF file and take the
same requests, each pass on a server started for it, alone on the machine: greedy, with the end-of-sequence token
banned, 128 tokens each (unless the command under the table sets `--max-tokens`), tokenmill with `--speculative off`
as the peers run without their lookup decoding (the workload tables measure speculation). The figures are the
single-stream decode speed and time to first token (TTFT); the aggregate speed, latency and TTFT at N concurrent
clients; peak resident memory (RSS); and start-up times, the first on an empty cache directory. Each figure is the
median over rounds that run the servers in turn, one way and then back (A B, B A), so that the machine's drift
between minutes falls on all of them alike. The ratio columns divide tokenmill's figure by the peer's: above 1 is
better for tok/s, below 1 for times and memory. Standard runs dated before 2026-12-07 kept every server up for the
whole run and took them in the same order each round (A B, A B).

A table headed by a workload is one `tokenmill bench --workload` run instead: speculative decoding on that
workload's prompts, tokenmill with it and without, and llama-server with its lookup decoding and without (the flags
under the table), each taking every prompt once as a single stream, then the concurrent clients. Its ratio columns
divide the speculating tokenmill's figures by each other system's.

A table headed by LoRA adapters is one `tokenmill bench --lora` run: tokenmill serving N random adapters and serving
none, and llama-server likewise (the same adapters as GGUF LoRA files); the single stream takes the first adapter, and
concurrent request i adapter i modulo N. Its ratio columns divide tokenmill-with-adapters' figures by each other
system's: the first is what the adapters cost, the second tokenmill against llama-server both serving them.

A table headed by prefix cache tiers is one `scripts/prefix_tiers.py` run: tokenmill alone, a long prefix's time to
first token cold and from each tier of its prefix cache (the disk tier's after a restart), and the prefix hit rate of
a working set four times larger than the live KV cache, with the tiers and without.

How to run it and what each figure means: [benchmarking](benchmarking.md).
"""


def load_runs(bench_dir: Path) -> list[tuple[str, dict[str, Any]]]:
    """(file name, results) of every run in `bench_dir`, by file name."""
    runs = []
    for path in sorted(bench_dir.glob("*.json")):
        results = json.loads(path.read_text())
        if "machine" not in results.get("meta", {}):
            raise ValueError(f"{path}: its meta has no machine (written by an older tokenmill bench): run it again")
        runs.append((path.name, results))
    return runs


def render(runs: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """The whole page: the intro, then per machine kind its heading and each of its runs."""
    kinds: dict[str, list[dict[str, Any]]] = {}
    for _, results in runs:
        kinds.setdefault(results["meta"]["machine"]["kind"], []).append(results)
    sections = [machine_section(kind_runs) for kind_runs in kinds.values()]
    return "\n".join([INTRO, *sections]).rstrip("\n") + "\n"


def machine_section(runs: Sequence[dict[str, Any]]) -> str:
    lines = [f"## {_machine_name(runs[0]['meta']['machine'])}", "", machine_line(runs), ""]
    for results in sorted(runs, key=lambda results: _run_order(results["meta"])):
        lines += [prefix_tiers_section(results) if "prefix_tiers" in results["meta"] else run_section(results), ""]
    return "\n".join(lines)


def _run_order(meta: dict[str, Any]) -> int:
    """The standard runs first, then the --workload ones, the --lora ones, then the prefix cache's."""
    return 3 if "prefix_tiers" in meta else 2 if "lora" in meta else 1 if "workload" in meta else 0


def machine_line(runs: Sequence[dict[str, Any]]) -> str:
    machine = runs[0]["meta"]["machine"]
    isa = ", ".join(machine["isa"]) or "none of avx2, avx512f, avx512_vnni, avx512_bf16, amx"
    # runs that summed over huge pages (memory_read_pages) speak for the machine where there are any: the older
    # small-page figures stay in their own tables' share rows
    huge = [r for r in runs if r["meta"].get("memory_read_pages") == "huge"]
    measured = [gb_s for r in huge or runs if (gb_s := r["meta"].get("memory_read_gb_s")) is not None]
    if not measured:
        return f"ISA: {isa}. Memory read bandwidth: not measured."
    return (
        f"ISA: {isa}. Memory read bandwidth: {statistics.median(measured):.1f} GB/s (a float32 sum over 1 GiB"
        f"{' in huge pages' if huge else ''} on every core, measured around each server's single-stream runs)."
    )


def run_section(results: dict[str, Any]) -> str:
    meta = results["meta"]
    heading = meta["model"] or "the server at --url"
    if "workload" in meta:
        heading += f", {meta['workload']['name']} workload"
    if "lora" in meta:
        heading += f", {meta['lora']['adapters']} LoRA adapters"
    lines = [f"### {heading}", "", *table(results["figures"], meta), ""]
    if "workload" in meta:
        lines += [*(f"- {line}" for line in workload_lines(meta["workload"]).splitlines()), ""]
    if "lora" in meta:
        lines += [f"- {lora_lines(meta['lora'])}", ""]
    lines += [f"`{meta['command']}`", "", provenance(meta)]
    if results.get("notes"):
        lines += ["", "Notes:", "", *(f"- {note}" for note in results["notes"])]
    return "\n".join(lines)


def prefix_tiers_section(results: dict[str, Any]) -> str:
    """A scripts/prefix_tiers.py run: a long prefix's time to first token from each tier, and a working set's hit
    rate with tiers and without."""
    meta, settings = results["meta"], results["meta"]["prefix_tiers"]
    restart = results["restart"]
    cold = restart["cold"]["ttft_s"]
    names = {
        "cold": "cold",
        "live": "from the live cache",
        "ram": "from the RAM tier",
        "disk": "from the disk tier, after a restart",
    }
    lines = [f"### {meta['model']}, prefix cache tiers", ""]
    lines += [_row([f"a {settings['prefix_tokens']:,}-token prefix", "TTFT", "÷ cold", "cached tokens", "servers"])]
    lines += [_row(["---", "---:", "---:", "---:", "---:"])]
    for name, figure in restart.items():
        ttft = figure["ttft_s"]
        cells = [names.get(name, name), f"{ttft * 1e3:,.0f} ms", f"{ttft / cold:.1%}", f"{figure['cached_tokens']:,}"]
        lines.append(_row([*cells, str(figure["samples"])]))
    working = results.get("working_set") or {}
    if working:
        size = next(iter(working.values()))["working_set_tokens"]
        lines += ["", _row([f"{size:,} tokens of prefixes, round after round", "prefix hit rate", "each round"])]
        lines.append(_row(["---", "---:", "---:"]))
        for name, result in working.items():
            rounds = ", ".join(f"{s:.1f} s" for s in result["round_s"])
            lines.append(_row([name, f"{result['hit_rate']:.1%}", rounds]))
    lines += [
        "",
        f"Each TTFT is the median over servers started in turn on one disk folder (the disk figure: all but the first)."
        f" The live KV cache holds {settings['live_tokens']:,} tokens"
        + ("; the hit rate is cached ÷ prompt tokens over the rounds after the first." if working else "."),
        "",
        f"`{meta['command']}`",
        "",
        provenance(meta),
    ]
    return "\n".join(lines)


def table(figures: dict[str, dict[str, float | None]], meta: dict[str, Any]) -> list[str]:
    """One row per figure any system has: each system's value, then tokenmill ÷ each peer."""
    ratio_table = ratios(figures)
    header = ["figure", "unit", *figures, *(name.replace("/", " ÷ ") for name in ratio_table)]
    lines = [_row(header), _row(["---", "---", *["---:"] * (len(header) - 2)])]
    for key, label, unit in rows(meta["table_concurrency"], meta.get("settings", {}).get("prefill_tokens", ())):
        if all(system.get(key) is None for system in figures.values()):
            continue
        cells = [format_value(system.get(key), unit) for system in figures.values()]
        cells += [_ratio(r.get(key)) for r in ratio_table.values()]
        lines.append(_row([label, unit, *cells]))
    return lines


def provenance(meta: dict[str, Any]) -> str:
    """When the run was made, with which tokenmill, and each peer's build."""
    build = meta["tokenmill"]
    commit = (
        f" at {build['commit'][:12]}" + (" (with local changes)" if build["dirty"] else "") if build["commit"] else ""
    )
    lines = [f"Run on {meta['date']} with tokenmill {build['version']}{commit}."]
    if meta["peers"]:
        lines += ["", *(f"- {name}: {_peer_build(info)}" for name, info in meta["peers"].items())]
    return "\n".join(lines)


def summary(runs: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """The README's table: per machine kind, model and peer, tokenmill's headline figures against the peer's (from
    the standard runs, not the --workload ones)."""
    runs = [(name, results) for name, results in runs if _run_order(results["meta"]) == 0]
    concurrency = max(max(results["meta"]["table_concurrency"]) for _, results in runs)
    headings = [heading.format(c=concurrency) for _, heading, _ in HEADLINE]
    lines = [_row(["machine", "model", "against", *headings]), _row(["---"] * (3 + len(headings)))]
    for _, results in runs:
        meta, figures = results["meta"], results["figures"]
        keys = [(key if key == "decode_tok_s" else f"c{concurrency}_{key}", unit) for key, _, unit in HEADLINE]
        ours = figures["tokenmill"]
        for peer, theirs in list(figures.items())[1:]:
            cells = [_versus(ours.get(key), theirs.get(key), unit) for key, unit in keys]
            lines.append(_row([_machine_name(meta["machine"]), meta["model"] or "–", peer, *cells]))
    lines.append("")
    lines += [f"- `{results['meta']['command']}` ({results['meta']['date'][:10]})" for _, results in runs]
    return "\n".join(lines)


def with_summary(readme: str, table: str) -> str:
    """`readme` with the lines between its figure markers replaced by `table`."""
    head, begin, rest = readme.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"the README has no {BEGIN} ... {END} lines to put the figures between")
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def _machine_name(machine: dict[str, Any]) -> str:
    microarch = f" ({machine['microarch']})" if machine["microarch"] else ""
    return f"{machine['cpu']}{microarch}, {machine['cores']} cores"


def _versus(ours: float | None, theirs: float | None, unit: str) -> str:
    """ "**2.39×** (111.6 vs 46.8 tok/s)": the ratio first, then the two figures it divides."""
    if ours is None or theirs is None or theirs == 0:
        return "–"
    return f"**{ours / theirs:.2f}×** ({format_value(ours, unit)} vs {format_value(theirs, unit)} {unit})"


def _peer_build(info: dict[str, str | None]) -> str:
    """What the peer says of itself, then where the bench got it (an sdist and its flags, or a binary's path)."""
    return "; ".join(part for part in (info["version"] or "version unknown", info["build"]) if part)


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenmill.bench.render", description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench-dir", type=Path, default=BENCH_DIR, help="the runs' JSON files (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=PAGE, help="the page to write (default: %(default)s)")
    parser.add_argument(
        "--readme", type=Path, default=README, help="whose figure lines get the headline table (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    runs = load_runs(args.bench_dir)
    if not runs:
        parser.error(
            f"no runs in {args.bench_dir}: write one with `tokenmill bench --compare --json {args.bench_dir}/`"
        )
    args.out.write_text(render(runs))
    args.readme.write_text(with_summary(args.readme.read_text(), summary(runs)))
    print(f"{args.out} and {args.readme}: {len(runs)} runs from {args.bench_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
