"""Batch-1 decode with one decode_burst against another, paired round by round in one process.

Each round measures the memory's read bandwidth, then runs one greedy generation (--tokens, ignore_eos) with each
burst length in turns, the order alternating; rounds are also summarised apart by the first length's speed (the
fast state: above --fast-above tok/s). The lengths share one engine: each sets the engine's decode_burst, and the
first generation at a length compiles its burst.

    python benchmarks/burst_pair.py --model ~/.cache/jserve/bench-135m --dtype bfloat16 --rounds 150 --bursts 8 32
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import cpu_kernels
from jserve import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(Path("~/.cache/jserve/bench-135m").expanduser()))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--bursts", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--fast-above", type=float, default=None,
                        help="tok/s of the first length above which a round counts as fast (default: 150 for "
                             "bfloat16, 75 for float32)")
    args = parser.parse_args()
    fast_above = args.fast_above or {"bfloat16": 150.0, "float32": 75.0}[args.dtype]

    llm = LLM(args.model, dtype=args.dtype)
    engine = llm.engine
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0.0)

    def generate(burst: int) -> tuple[float, list[int]]:
        engine.config = dataclasses.replace(engine.config, decode_burst=burst)
        start = time.perf_counter()
        tokens = llm.generate(["hello world"], params, use_tqdm=False)[0].outputs[0].token_ids
        return (args.tokens - 1) / (time.perf_counter() - start), tokens

    reference = {burst: generate(burst)[1] for burst in args.bursts}  # compiles each length's burst
    if any(tokens != reference[args.bursts[0]] for tokens in reference.values()):
        raise SystemExit("the burst lengths gave different tokens")
    speeds: dict[int, list[float]] = {burst: [] for burst in args.bursts}
    for r in range(args.rounds):
        bandwidth = cpu_kernels.read_bandwidth(256 << 20, repeats=2) / 1e9
        row = {}
        for burst in args.bursts if r % 2 == 0 else args.bursts[::-1]:
            row[burst] = generate(burst)[0]
            speeds[burst].append(row[burst])
        print(f"{bandwidth:5.1f} GB/s  " + "  ".join(f"burst {b}: {row[b]:6.1f} tok/s" for b in args.bursts),
              flush=True)
    first = speeds[args.bursts[0]]
    for burst in args.bursts[1:]:
        ratios = [b / a for a, b in zip(first, speeds[burst], strict=True)]
        for name, keep in (("all", lambda a: True), ("fast", lambda a: a > fast_above),
                           ("slow", lambda a: a <= fast_above)):
            picked = [ratio for a, ratio in zip(first, ratios, strict=True) if keep(a)]
            if picked:
                print(f"burst {burst} / burst {args.bursts[0]}, {name} rounds: median {statistics.median(picked):.3f} "
                      f"({sum(x > 1 for x in picked)} of {len(picked)} faster)")


if __name__ == "__main__":
    main()
