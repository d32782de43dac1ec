"""The fleet on simulated engines: how the ingress scales, and what routing by cached prefixes buys, on this machine.

    python scripts/fleet_bench.py                                # both parts, the packaged model's tokenizer
    python scripts/fleet_bench.py --parts ingress --ingresses 1 2 4 --json docs/bench/fleet.json

Every system is `tokenmill serve --replicas 8 --simulate-engine` (cluster/simulated.py: engine replicas that sleep
each step's measured service time instead of computing it, so eight of them cost the two cores nothing and the
ingresses, the proxy and the router are what is measured):
- **ingress**: the same saturating load (streamed requests of `--max-tokens` tokens from `--clients` clients) on 1, 2
  and 4 ingress replicas: requests/s and streamed tokens/s, and each as a ratio to one ingress;
- **routing**: `tokenmill bench --multi-round-qa`'s workload on 2 ingresses, routed by cached prefixes (the default)
  and by Ray's power of two choices (`--no-prefix-affinity`): throughput, TTFT p50/p90 and the share of prompt
  tokens served from the replicas' caches.
Ray probes outward network addresses, so the script re-runs itself under `unshare -n` (as replica_bench.py does);
everything stays on 127.0.0.1 and every loop is bounded in count and time. Server logs go to .bench/fleet-bench/.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from replica_bench import START_TIMEOUT_S, TermStoppedServer, ensure_private_network, wait_ok

from tokenmill.bench import load
from tokenmill.bench.load import LoadSettings, discover, make_client
from tokenmill.bench.machine import describe_machine
from tokenmill.bench.multi_round import MultiRoundSettings, run_multi_round
from tokenmill.bench.report import write_json
from tokenmill.bench.servers import ServerStartError, cpu_cores, free_port, tokenmill_spec

ROOT = Path(__file__).resolve().parent.parent
FLEET = ("--replicas", "8", "--simulate-engine")
PROMPT = "Write a short note about the rivers of the north and the towns along them."


def serve(flags: Sequence[str], name: str, args: argparse.Namespace, log_dir: Path) -> TermStoppedServer:
    extra = ["--stream-interval", str(args.stream_interval)]
    if args.service_times:
        extra += ["--simulated-service-times", args.service_times]
    spec = tokenmill_spec(free_port(), args.model, [*FLEET, *extra, *flags])
    env = {"PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    server = TermStoppedServer(dataclasses.replace(spec, name=name, env=env), log_dir)
    print(f"{name}: starting (log {server.log_path})", flush=True)
    server.start(START_TIMEOUT_S)
    wait_ok(server.url, START_TIMEOUT_S)
    return server


async def saturate(url: str, args: argparse.Namespace) -> dict[str, Any]:
    settings = LoadSettings(
        max_tokens=args.max_tokens,
        eos_ids=(),  # the simulated engine never stops early
        concurrency=(args.clients,),
        requests=args.requests,
        level_timeout_s=args.duration,
        request_timeout_s=120.0,
        prompts=(PROMPT,),
    )
    async with make_client(settings) as client:
        model, _ = await discover(client, url)
        warm = dataclasses.replace(settings, requests=args.clients)
        await load.run_level(client, url, model, warm, (), args.clients)
        level = await load.run_level(client, url, model, settings, (), args.clients)
    level.pop("digests", None)
    level["req_s"] = (level["requests"] - level["failed"]) / level["wall_s"] if level["wall_s"] else None
    return level


def ingress_part(args: argparse.Namespace, log_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for count in args.ingresses:
        server = serve(("--ingress-replicas", str(count)), f"ingress-{count}", args, log_dir)
        try:
            rows.append({"ingresses": count, **load.run(saturate(server.url, args))})
        except (ServerStartError, OSError) as exc:
            rows.append({"ingresses": count, "error": str(exc)})
        finally:
            server.stop()
        print(rows[-1], flush=True)
    base = rows[0]
    for row in rows:
        for figure in ("req_s", "agg_tok_s"):
            if row.get(figure) and base.get(figure):
                row[f"{figure}_vs_one"] = row[figure] / base[figure]
                row[f"{figure}_vs_linear"] = row[figure] / (base[figure] * row["ingresses"] / base["ingresses"])
    return rows


def routing_part(args: argparse.Namespace, log_dir: Path) -> list[dict[str, Any]]:
    settings = MultiRoundSettings(
        users=args.users,
        rounds=args.rounds,
        qps=args.qps,
        system_words=args.system_words,
        history_words=args.history_words,
        answer_tokens=args.answer_tokens,
        duration_s=args.duration,
        request_timeout_s=120.0,
    )
    rows = []
    for label, flags in (("prefix", ()), ("two-choices", ("--no-prefix-affinity",))):
        server = serve(("--ingress-replicas", "2", *flags), f"routing-{label}", args, log_dir)
        try:
            rows.append({"routing": label, **load.run(run_multi_round(server.url, settings))})
        finally:
            server.stop()
        print({k: v for k, v in rows[-1].items() if k != "settings"}, flush=True)
    return rows


def table(rows: list[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """A markdown table; a form ending in "ms" writes seconds as milliseconds."""
    lines = ["| " + " | ".join(title for title, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for _, key, form in columns:
            value = row.get(key)
            if value is None:
                cells.append("–")
            elif form.endswith("ms"):
                cells.append(format(value * 1e3, form.removesuffix("ms")) + " ms")
            else:
                cells.append(format(value, form))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="the model whose tokenizer the simulated replicas use")
    p.add_argument("--parts", nargs="+", choices=("ingress", "routing"), default=["ingress", "routing"])
    p.add_argument("--ingresses", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--clients", type=int, default=48, help="ingress part: streaming clients at once")
    p.add_argument("--requests", type=int, default=600, help="ingress part: requests per system")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--stream-interval", type=int, default=1, help="every system's --stream-interval")
    p.add_argument(
        "--service-times",
        default=None,
        help="the replicas' --simulated-service-times (T_FIXED,T_PER_SEQ,T_PER_PREFILL_TOKEN from"
        " scripts/replica_service_times.py); default: the packaged model's",
    )
    p.add_argument("--users", type=int, default=32, help="routing part: conversations at once")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--qps", type=float, default=4.0)
    p.add_argument("--system-words", type=int, default=500)
    p.add_argument("--history-words", type=int, default=1000)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--duration", type=float, default=90.0, help="seconds per system: no request starts after")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def main() -> int:
    ensure_private_network()
    args = parse_args()
    log_dir = ROOT / ".bench" / "fleet-bench"
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "command": " ".join(["python", "scripts/fleet_bench.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": describe_machine(cpu_cores()),
    }
    if "ingress" in args.parts:
        results["ingress"] = ingress_part(args, log_dir)
        columns = [
            ("ingresses", "ingresses", "d"),
            ("req/s", "req_s", ".1f"),
            ("streamed tok/s", "agg_tok_s", ".0f"),
            ("req/s ÷ linear", "req_s_vs_linear", ".2f"),
            ("TTFT p50", "ttft_p50_s", ",.0fms"),
            ("failed", "failed", "d"),
        ]
        print(table(results["ingress"], columns))
    if "routing" in args.parts:
        results["routing"] = routing_part(args, log_dir)
        columns = [
            ("routing", "routing", "s"),
            ("req/s", "req_s", ".2f"),
            ("tok/s", "tok_s", ".0f"),
            ("TTFT p50", "ttft_p50_s", ",.0fms"),
            ("TTFT p90", "ttft_p90_s", ",.0fms"),
            ("prompt cached", "cached_share", ".0%"),
            ("failed", "failed", "d"),
        ]
        print(table(results["routing"], columns))
    if args.json is not None:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
