"""The ``llama-cache`` command: a thin layer over the public API.

    llama-cache demo [--model PATH]     two interleaved chats, per-turn time to first token, with and
                                        without a cache plugged into a plain llama_cpp.Llama
    llama-cache bench [--model PATH]    time to first token cold / llama-cpp-python's cache / ours
    llama-cache inspect DIR [--check]   a disk cache's entries, sizes, models and hits; --fix repairs
    llama-cache serve [--model PATH]    an OpenAI-compatible server with the prompt cache on
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from llama_cache._model import default_model_path
from llama_cache.inspection import add_inspect_command, run_inspect
from llama_cache.server.config import add_serve_command, config_from_args


def _model_parent() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--model",
        type=Path,
        default=None,
        help="GGUF model to load (default: $LLAMA_CACHE_MODEL, else the embedded SmolLM2-135M-Instruct)",
    )
    return parent


def _resolve_model(path: Path | None) -> Path:
    if path is None:
        return default_model_path()
    if not path.is_file():
        raise SystemExit(f"llama-cache: model file not found: {path}")
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llama-cache",
        description="Prefix-state caching for llama.cpp: reuse computed model state across prompts.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    model = _model_parent()
    demo = commands.add_parser(
        "demo",
        parents=[model],
        help="interleaved chats on a plain llama_cpp.Llama, with and without LlamaCache",
    )
    demo.add_argument("--turns", type=int, default=3, help="turns per conversation (default 3)")
    demo.add_argument("--max-tokens", type=int, default=24, help="tokens generated per turn (default 24)")
    bench = commands.add_parser(
        "bench",
        parents=[model],
        help="time to first token: cold, llama-cpp-python's cache, llama-cache (table + JSON)",
    )
    bench.add_argument("--prompt-tokens", type=int, default=1500, help="document length (default 1500)")
    bench.add_argument("--turns", type=int, default=10, help="chat turns (default 10)")
    bench.add_argument("--out", type=Path, default=Path("benchmarks/results/bench.json"), help="JSON output")
    add_inspect_command(commands, [])
    add_serve_command(commands, [model])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from llama_cache.demo import run_demo

        if args.turns < 1 or args.max_tokens < 1:
            raise SystemExit("llama-cache: --turns and --max-tokens must be positive")
        print(run_demo(_resolve_model(args.model), turns=args.turns, max_tokens=args.max_tokens))
        return 0
    if args.command == "bench":
        from llama_cache.bench import run_bench

        if args.prompt_tokens < 16 or args.turns < 1:
            raise SystemExit("llama-cache: --prompt-tokens must be >= 16 and --turns positive")
        print(run_bench(_resolve_model(args.model), args.prompt_tokens, args.turns, args.out))
        return 0
    if args.command == "inspect":
        status, report = run_inspect(args)
        print(report, file=sys.stderr if status == 2 else sys.stdout)
        return status
    if args.command == "serve":
        import logging

        from llama_cache.server import serve

        try:
            config = config_from_args(args)
        except ValueError as error:
            raise SystemExit(f"llama-cache: {error}") from None
        if config.model_path is not None:
            _resolve_model(config.model_path)
        logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
        try:
            serve(config)
        except OSError as error:  # the address in use, a TLS file unreadable or not a key and certificate
            raise SystemExit(f"llama-cache: cannot serve: {error}") from None
        return 0
    raise AssertionError(f"unhandled command {args.command}")  # argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
