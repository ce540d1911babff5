"""`jserve eval perplexity`: argparse wiring; the command imports its module only when it runs."""

from __future__ import annotations

import argparse

from jserve.arg_types import integer, output_file
from jserve.engine_args import add_engine_args
from jserve.eval import DEFAULT_TEXT


def add_perplexity_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("perplexity", help="perplexity on a text, scored as llama.cpp's llama-perplexity scores it",
                       description="Perplexity of --model on --text through the engine's prompt logprobs, with "
                                   "llama.cpp's llama-perplexity windows (jserve/eval/perplexity.py), so the "
                                   "figures compare: --context C is llama-perplexity -c C.")
    p.add_argument("--text", default=str(DEFAULT_TEXT),
                   help="UTF-8 text file (default: the bundled held-out English prose, 34 KB)")
    p.add_argument("--context", type=integer(3), default=512,
                   help="tokens a window reads (llama-perplexity's -c); the text must give twice as many")
    p.add_argument("--stride", type=integer(0), default=0,
                   help="0: llama-perplexity's default scheme (non-overlapping windows of --context tokens, BOS "
                        "first, the second half of each scored); S in [1, context - 1]: its --ppl-stride S scheme "
                        "(a window of --context tokens every S tokens, its last S scored)")
    p.add_argument("--chunks", type=integer(1), default=None,
                   help="score only the first N windows (llama-perplexity's --chunks)")
    p.add_argument("--add-bos", action=argparse.BooleanOptionalAction, default=None,
                   help="put BOS first (default: where the tokenizer does, as llama.cpp follows the GGUF's "
                        "add_bos_token)")
    p.add_argument("--output-json", type=output_file, help="write the results (and settings) to this JSON file")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    add_engine_args(p)
    p.set_defaults(run=_run_perplexity)


def add_eval_parser(subparsers: argparse._SubParsersAction) -> None:
    ev = subparsers.add_parser("eval", help="model quality: perplexity")
    sub = ev.add_subparsers(dest="eval_command", required=True)
    add_perplexity_parser(sub)


def _run_perplexity(args: argparse.Namespace) -> int:
    from jserve.eval.perplexity import run_perplexity

    return run_perplexity(args)
