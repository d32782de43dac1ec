"""`tokenmill serve | complete | models | bench`: the command line, with flags generated from Config."""

from __future__ import annotations

import argparse
import asyncio
import gc
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
            return serve_forever(config)
        if args.command == "complete":
            return asyncio.run(complete_once(config, args.prompt, args.max_tokens, args.temperature))
        return show_model(config)
    except _start_errors() as exc:  # a model or file this server cannot use: one line that says why, not a traceback
        print(f"tokenmill {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _start_errors() -> tuple[type[Exception], ...]:
    """Imported only when an exception is on its way out (the engine, and torch with it, load lazily)."""
    from tokenmill.engine.build import ModelLoadError
    from tokenmill.engine.content_filter import ContentFilterError

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


def serve_forever(config: Config) -> int:
    if config.on_ray:
        return serve_replicas(config)
    from tokenmill.engine.ahead import hash_models_ahead

    hash_models_ahead(config)  # first: the imports below hold the GIL for over a second, and hashing needs none
    # Loading makes millions of objects (torch's import, a tokenizer's vocabulary and merges) and frees few of them:
    # the cyclic collector's full passes over them found next to nothing and cost ~0.5 s of a start. It is back on
    # once the models are loaded (freeze_loaded_objects); a start that fails exits.
    gc.disable()
    from tokenmill.api.app import create_app
    from tokenmill.api.serve import serve
    from tokenmill.engine.build import ModelLoadError
    from tokenmill.engine.content_filter import ContentFilter
    from tokenmill.engine.engine import AsyncEngine

    if config.content_filter:  # a bad filter file fails the start before the models load
        ContentFilter.from_file(config.content_filter)
    engines = [AsyncEngine.from_config(one) for one in config.per_model()]
    names = [engine.model_name for engine in engines]
    if len(set(names)) < len(names):
        raise ModelLoadError(
            f"two models would be served as the same id ({', '.join(names)}): name them apart with"
            " --served-model-name or NAME=PATH"
        )
    return serve(create_app(engines, config), config)


def serve_replicas(config: Config) -> int:
    """--replicas, --max-replicas or --ray-address: the same app on Ray Serve (tokenmill/cluster/, the [ray] extra)."""
    try:
        from tokenmill.cluster.launch import serve_on_ray
    except ImportError as exc:
        print(f"tokenmill serve --replicas needs Ray Serve: pip install 'tokenmill[ray]' ({exc})", file=sys.stderr)
        return 2
    return serve_on_ray(config)


async def complete_once(config: Config, prompt: str, max_tokens: int, temperature: float) -> int:
    from tokenmill.engine.engine import AsyncEngine
    from tokenmill.engine.sampling import SamplingParams

    engine = AsyncEngine.from_config(config.per_model()[0])
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
    from tokenmill.engine.engine import AsyncEngine

    for one in config.per_model():
        engine = AsyncEngine.from_config(one)
        print(
            f"model: {engine.model_name}\nmax_model_len: {engine.max_model_len}\n"
            f"system_fingerprint: {engine.system_fingerprint}\nkv blocks: {engine.core.blocks.num_blocks}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
