"""The `jserve` command. Each subcommand registers itself with `add_parser(subparsers)` and sets `run`.

`generate` runs a batch job over a JSONL file; `convert` writes a checkpoint as an Orbax one (jserve.convert);
`serve`, `bench`, `eval`, `chat` live in their own modules.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from jserve.arg_types import integer, output_file
from jserve.bench.cli import add_bench_parser
from jserve.chat import add_chat_parser
from jserve.config import QUANTIZATIONS, SUPPORTED_DTYPES, ModelLoadError
from jserve.engine_args import add_engine_args, engine_config_from_args
from jserve.eval.cli import add_eval_parser
from jserve.server.cli import add_serve_parser
from jserve.server.lora_modules import lora_module_arg


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="offline batch generation over a JSONL file")
    gen.add_argument("--input", required=True, help="JSONL: one object per line with 'prompt' or 'messages', "
                                                     "an optional 'id' and 'priority', and any SamplingParams "
                                                     "fields; any other key makes the line malformed")
    gen.add_argument("--output", required=True, type=output_file,
                     help="JSONL results, appended and flushed as each finishes")
    gen.add_argument("--strict", action="store_true",
                     help="stop (status 2) at the first malformed line or refused request instead of skipping it")
    gen.add_argument("--max-tokens", type=integer(1), default=None,
                     help="max_tokens for lines that set none (default: the model's generation_config.json "
                          "max_new_tokens where it has one, else 128)")
    gen.add_argument("--lora-modules", type=lora_module_arg, nargs="+", action="extend", default=None,
                     metavar="NAME=PATH",
                     help="LoRA adapters (PEFT directories) a line runs with by naming one in its 'model' field; "
                          "needs --enable-lora")
    add_engine_args(gen)
    gen.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from jserve.batch import run_batch

    modules = args.lora_modules or []
    names = [m.name for m in modules]
    if len(set(names)) < len(names):
        raise ValueError(f"--lora-modules: several adapters are named {next(n for n in names if names.count(n) > 1)!r}")
    return run_batch(engine_config_from_args(args), Path(args.input), Path(args.output),
                     strict=args.strict, default_max_tokens=args.max_tokens, loras={m.name: m.path for m in modules})


def add_convert_parser(sub: argparse._SubParsersAction) -> None:
    conv = sub.add_parser("convert", help="write a checkpoint as a jserve Orbax checkpoint directory, which "
                                          "--model then serves without converting at start-up")
    conv.add_argument("--model", required=True, help="what --model takes: a Hugging Face safetensors directory, a "
                                                     "GGUF file or a directory holding one")
    conv.add_argument("--out", required=True, help="a new or empty directory to write")
    conv.add_argument("--dtype", choices=SUPPORTED_DTYPES, default="float32",
                      help="parameter dtype stored (and served: serve it with the same --dtype; default: "
                           "%(default)s)")
    conv.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                      help="store the decoder layers' matrices quantized, with per-row scales (served quantized "
                           "without --quantization; docs/quantization.md)")
    conv.set_defaults(run=_run_convert)


def _run_convert(args: argparse.Namespace) -> int:
    from jserve.convert import convert
    from jserve.orbax_io import read_checkpoint

    out = convert(args.model, args.out, args.dtype, args.quantization)
    # The marker, not the flag: a source quantized elsewhere (compressed-tensors) is stored int8 without the flag.
    quantization = read_checkpoint(out).quantization
    stored = args.dtype if quantization is None else f"{args.dtype}, {quantization} weights"
    print(f"wrote {out} ({stored}); serve it with: jserve serve --model {out} --dtype {args.dtype}")
    return 0


# Each entry adds one subcommand; the modules import nothing heavy until their command runs.
SUBCOMMAND_PARSERS = [add_generate_parser, add_serve_parser, add_bench_parser, add_eval_parser, add_convert_parser,
                      add_chat_parser]


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
