"""`jserve bench throughput|latency|serve`: argparse wiring; each command imports its module only when it runs.

Flag names follow vLLM's `vllm bench` where the concept matches, so commands carry over.
"""

from __future__ import annotations

import argparse

from jserve.arg_types import integer, non_negative_float, output_file, positive_float, range_ratio
from jserve.bench import DATASETS
from jserve.engine_args import add_engine_args

# The --random-* flags' values where they are not given. Their argparse default is None, so that giving one is seen.
RANDOM_DEFAULTS = {"random_input_len": 1024, "random_output_len": 128, "random_range_ratio": 0.0}


def add_dataset_args(parser: argparse.ArgumentParser, *, default_dataset: str | None, default_num_prompts: int,
                     with_seed: bool) -> None:
    """default_dataset None: random when a --random-* flag is given, else mixed (see resolve_dataset_args).
    with_seed: False where the engine flags already define --seed (it then seeds the requests too)."""
    group = parser.add_argument_group("dataset")
    default_help = ("random when a --random-* flag is given, else mixed" if default_dataset is None
                    else default_dataset)
    group.add_argument("--dataset", "--dataset-name", dest="dataset", choices=DATASETS, default=default_dataset,
                       help="random: uniform random tokens; prefix-repetition: shared prefixes + random suffixes; "
                            "mixed: ShareGPT-like synthetic (prompts 16-1024, outputs 16-512 tokens, log-uniform); "
                            f"sharegpt: a ShareGPT-format JSON file (--dataset-path) (default: {default_help})")
    group.add_argument("--dataset-path", help="ShareGPT-format JSON for --dataset sharegpt")
    group.add_argument("--num-prompts", type=integer(1), default=default_num_prompts, help="how many requests")
    group.add_argument("--random-input-len", type=integer(1), default=None,
                       help=f"random: mean prompt tokens (default {RANDOM_DEFAULTS['random_input_len']})")
    group.add_argument("--random-output-len", type=integer(1), default=None,
                       help=f"random: mean output tokens (default {RANDOM_DEFAULTS['random_output_len']})")
    group.add_argument("--random-range-ratio", type=range_ratio, default=None,
                       help="random: lengths are uniform in [len * (1 - r), len * (1 + r)] (default 0)")
    group.add_argument("--prefix-repetition-prefix-len", type=integer(0), default=256)
    group.add_argument("--prefix-repetition-suffix-len", type=integer(1), default=256)
    group.add_argument("--prefix-repetition-num-prefixes", type=integer(1), default=10)
    group.add_argument("--prefix-repetition-output-len", type=integer(1), default=128)
    group.add_argument("--sharegpt-output-len", type=integer(1), default=None,
                       help="sharegpt: generate this many tokens instead of the recorded answer's length")
    if with_seed:
        group.add_argument("--seed", type=int, default=0, help="seeds the requests and their arrival times")
    parser.add_argument("--result-json", type=output_file, help="write the results (and settings) to this JSON file")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def resolve_dataset_args(args: argparse.Namespace) -> None:
    """Fill in what the dataset flags leave open: with no --dataset, the --random-* flags mean the random data set
    (as in vLLM's `bench throughput`), else mixed; --random-* flags beside another --dataset are an error rather
    than silently unused. The --random-* flags not given take RANDOM_DEFAULTS."""
    given = [name for name in RANDOM_DEFAULTS if getattr(args, name) is not None]
    if args.dataset is None:
        args.dataset = "random" if given else "mixed"
    if given and args.dataset != "random":
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        verb = "applies" if len(given) == 1 else "apply"
        raise ValueError(f"{flags} {verb} to --dataset random only, not --dataset {args.dataset}")
    for name, default in RANDOM_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def add_throughput_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("throughput", help="offline throughput of jserve or transformers on the same requests")
    p.add_argument("--backend", choices=("jserve", "hf"), default="jserve",
                   help="hf: transformers generate() with static batches, the baseline without a server")
    p.add_argument("--hf-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--hf-batch-size", type=integer(1), default=32, help="rows per static batch for --backend hf")
    p.add_argument("--hf-sort", action=argparse.BooleanOptionalAction, default=True,
                   help="sort requests longest first before batching (less padding: the strongest baseline)")
    add_dataset_args(p, default_dataset=None, default_num_prompts=256, with_seed=False)
    add_engine_args(p)
    p.set_defaults(run=_run_throughput)


def add_latency_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("latency", help="batch-1 prefill and decode speed beside the memory-bandwidth roofline")
    p.add_argument("--input-len", type=integer(1), default=128, help="prompt tokens")
    p.add_argument("--output-len", type=integer(2), default=128, help="generated tokens")
    p.add_argument("--num-iters-warmup", type=integer(0), default=2)
    p.add_argument("--num-iters", type=integer(1), default=10)
    p.add_argument("--result-json", type=output_file, help="write the results to this JSON file")
    add_engine_args(p)
    p.set_defaults(run=_run_latency)


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="load-test any OpenAI-compatible streaming server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without the endpoint path")
    p.add_argument("--endpoint", choices=("/v1/completions", "/v1/chat/completions"), default="/v1/completions")
    p.add_argument("--model", help="model name to request; a local directory also provides the tokenizer")
    p.add_argument("--served-model-name", help="the name sent in requests when it differs from --model "
                                               "(default: --model, else the first of GET /v1/models)")
    p.add_argument("--tokenizer", help="local tokenizer directory for building prompts (default: --model)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--request-rate", type=positive_float, default=float("inf"),
                   help="requests per second (inf: all at once); gaps are gamma-distributed, Poisson by default")
    p.add_argument("--burstiness", type=positive_float, default=1.0,
                   help="gamma shape of the gaps: 1 = Poisson, < 1 burstier, > 1 more regular")
    p.add_argument("--max-concurrency", type=integer(1), default=None, help="most requests in flight at once")
    p.add_argument("--ignore-eos", action="store_true", help="ask the server to generate every requested token")
    p.add_argument("--temperature", type=non_negative_float, default=0.0)
    p.add_argument("--structured-output", choices=("none", "json-schema"), default="none",
                   help="json-schema: every request asks for JSON of a fixed schema (response_format)")
    p.add_argument("--goodput", nargs="+", metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (names: ttft, tpot, e2el)")
    p.add_argument("--plot", metavar="PNG", type=output_file,
                   help="write latency CDFs and throughput over time to this PNG")
    add_dataset_args(p, default_dataset="random", default_num_prompts=1000, with_seed=True)
    p.set_defaults(run=_run_serve)


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: throughput, latency, serve")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    add_throughput_parser(sub)
    add_latency_parser(sub)
    add_serve_parser(sub)


def _run_throughput(args: argparse.Namespace) -> int:
    from jserve.bench.throughput import run_throughput

    resolve_dataset_args(args)
    return run_throughput(args)


def _run_latency(args: argparse.Namespace) -> int:
    from jserve.bench.latency import run_latency

    return run_latency(args)


def _run_serve(args: argparse.Namespace) -> int:
    from jserve.bench.serve import run_serve

    resolve_dataset_args(args)
    return run_serve(args)
