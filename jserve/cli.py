"""The `jserve` command. Each subcommand registers itself with `add_parser(subparsers)` and sets `run`.

`generate` runs a batch job over a JSONL file; `serve`, `bench` live in their own modules.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import typing
from pathlib import Path

from jserve.bench.cli import add_bench_parser
from jserve.config import EngineConfig, ModelLoadError
from jserve.server.cli import add_serve_parser


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, so the CLI, the server and the Python API share every knob."""
    hints = typing.get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kind = hints[f.name]
        if kind is bool:
            group.add_argument(flag, default=default, action=argparse.BooleanOptionalAction)
        else:
            base = int if "int" in str(kind) else float if "float" in str(kind) else str
            group.add_argument(flag, default=default, type=base, metavar=f.name.upper())


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="offline batch generation over a JSONL file")
    gen.add_argument("--input", required=True, help="JSONL: one object per line with 'prompt' or 'messages', "
                                                     "an optional 'id' and optional sampling fields")
    gen.add_argument("--output", required=True, help="JSONL results, appended and flushed as each finishes")
    gen.add_argument("--strict", action="store_true", help="stop at the first malformed line instead of skipping it")
    gen.add_argument("--max-tokens", type=int, default=128, help="default max_tokens for lines that set none")
    add_engine_args(gen)
    gen.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from jserve.batch import run_batch

    return run_batch(engine_config_from_args(args), Path(args.input), Path(args.output),
                     strict=args.strict, default_max_tokens=args.max_tokens)


# Each entry adds one subcommand; the modules import nothing heavy until their command runs.
SUBCOMMAND_PARSERS = [add_generate_parser, add_serve_parser, add_bench_parser]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jserve", description="LLM serving on JAX/XLA")
    sub = parser.add_subparsers(dest="command", required=True)
    for add_parser in SUBCOMMAND_PARSERS:
        add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except (ModelLoadError, ValueError, OSError) as e:
        print(f"jserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("jserve: interrupted; finished results are saved", file=sys.stderr)
        return 130
