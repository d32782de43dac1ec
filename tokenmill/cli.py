"""`tokenmill serve | complete | models | bench`: the command line, with flags generated from Config."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from tokenmill.api.logs import configure_logging
from tokenmill.bench.flags import add_bench_arguments
from tokenmill.config import ENV_HELP, Config, ConfigError, add_config_arguments, config_from_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill", description="OpenAI-compatible completions server")
    commands = parser.add_subparsers(dest="command", required=True)
    config_command(commands, "serve", "start the HTTP server (default model: Gemma 3 270M)")
    complete = config_command(commands, "complete", "complete one prompt on the command line, no server")
    complete.add_argument("prompt")
    complete.add_argument("--max-tokens", type=int, default=32)
    complete.add_argument("--temperature", type=float, default=0.0)
    config_command(commands, "models", "print the model the server would serve, and its settings")
    add_bench_arguments(commands.add_parser("bench", help="benchmark a server, or tokenmill against llama.cpp"))
    args = parser.parse_args(argv)
    if args.command == "bench":
        return run_bench(args)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        commands.choices[args.command].error(str(exc))  # usage and exit 2, as argparse does for a bad flag
    if args.command == "complete" and len(config.model) > 1:
        commands.choices[args.command].error("complete takes one --model")
    configure_logging(config.log_level, config.log_format)
    try:
        if args.command == "serve":
            return serve(config)
        if args.command == "complete":
            return asyncio.run(complete_once(config, args.prompt, args.max_tokens, args.temperature))
        return show_model(config)
    except _start_errors() as exc:  # a model or file this server cannot use: one line that says why, not a traceback
        print(f"tokenmill {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _start_errors() -> tuple[type[Exception], ...]:
    """Imported only when an exception is on its way out (the engine, and torch with it, load lazily)."""
    from tokenmill.engine.content_filter import ContentFilterError
    from tokenmill.server.load import ModelLoadError

    return ModelLoadError, ContentFilterError


def config_command(commands: Any, name: str, help: str) -> argparse.ArgumentParser:
    """A subcommand that takes every Config setting as a flag (and says so of the TOKENMILL_* variables)."""
    command: argparse.ArgumentParser = commands.add_parser(name, help=help, epilog=ENV_HELP)
    add_config_arguments(command)
    return command


def run_bench(args: argparse.Namespace) -> int:
    try:
        from tokenmill.bench.run import run_bench as bench
    except ImportError as exc:
        print(f"tokenmill bench needs its extra: pip install 'tokenmill[bench]' ({exc})", file=sys.stderr)
        return 2
    return bench(args)


def serve(config: Config) -> int:
    """One process (tokenmill/server/), or replicas on Ray Serve."""
    if config.on_ray:
        return serve_replicas(config)
    from tokenmill.server.start import serve_forever

    return serve_forever(config)


def serve_replicas(config: Config) -> int:
    """--replicas, --max-replicas or --ray-address: the same app on Ray Serve (tokenmill/cluster/, the [ray] extra)."""
    try:
        from tokenmill.cluster.launch import serve_on_ray
    except ImportError as exc:
        print(f"tokenmill serve --replicas needs Ray Serve: pip install 'tokenmill[ray]' ({exc})", file=sys.stderr)
        return 2
    return serve_on_ray(config)


async def complete_once(config: Config, prompt: str, max_tokens: int, temperature: float) -> int:
    from tokenmill.engine.sampling import SamplingParams
    from tokenmill.server.load import load_engine

    engine = load_engine(config.per_model()[0])
    await engine.start()
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
    async for out in engine.generate("cli", engine.tokenizer.encode(prompt), params):
        for delta in out.deltas:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    await engine.stop()
    return 0


def show_model(config: Config) -> int:
    from tokenmill.server.load import load_engine

    for one in config.per_model():
        engine = load_engine(one)
        print(
            f"model: {engine.model_name}\nmax_model_len: {engine.max_model_len}\n"
            f"system_fingerprint: {engine.system_fingerprint}\nkv blocks: {engine.core.blocks.num_blocks}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
