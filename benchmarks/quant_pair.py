"""Batch-1 decode with int8 weights against bfloat16, both engines in one process taking turns, paired round by
round, for machines whose memory bandwidth moves while they run.

    python benchmarks/quant_pair.py [--rounds 12] [--model DIR] [--load-format dummy] [--output-len 128]

Each round measures the read bandwidth, then runs one request (a 32-token prompt, greedy tokens, as `jserve bench
latency` times it) on each engine, the order alternating. A round whose bandwidth reads alike before and after
compares the two under one memory state; the summary gives the median ratio of such rounds for each state.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

FAST_GBPS = 50.0  # the bandwidth that splits the rounds into the memory's two states on the 2-core EPYC


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--model", type=Path, default=Path("~/.cache/jserve/bench-135m").expanduser())
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--executor", default="cpu-layers")
    args = parser.parse_args()

    from jserve.bench.latency import time_request
    from jserve.bench.roofline import stream_bandwidth
    from jserve.llm import LLM

    engines = {name: LLM(model=str(args.model), dtype="bfloat16", quantization=quantization,
                         executor=args.executor, load_format=args.load_format, max_num_seqs=4,
                         max_model_len=512, kv_cache_memory_bytes=64 << 20).engine
               for name, quantization in (("int8", "int8"), ("bf16", None))}
    prompt = list(range(100, 132))
    for engine in engines.values():
        time_request(engine, "warm", prompt, 8)  # untimed: the first request's Python paths
    rows = []
    for i in range(args.rounds):
        before = stream_bandwidth(128 << 20) / 1e9
        rates = {}
        for name in (("int8", "bf16") if i % 2 else ("bf16", "int8")):
            _, decode = time_request(engines[name], f"pair-{i}", prompt, args.output_len)
            rates[name] = (args.output_len - 1) / decode
        after = stream_bandwidth(128 << 20) / 1e9
        rows.append((before, after, rates["int8"], rates["bf16"]))
        print(f"round {i}: {before:.0f} -> {after:.0f} GB/s  int8 {rates['int8']:.1f}  bf16 {rates['bf16']:.1f} tok/s"
              f"  {rates['int8'] / rates['bf16']:.2f}x", flush=True)
    for state, alike in (("fast", lambda b, a: b > FAST_GBPS and a > FAST_GBPS),
                         ("slow", lambda b, a: b < FAST_GBPS and a < FAST_GBPS)):
        chosen = [r for r in rows if alike(r[0], r[1])]
        if chosen:
            print(f"{state} memory ({len(chosen)} rounds, {statistics.median(r[0] for r in chosen):.0f} GB/s): int8 "
                  f"{statistics.median(r[2] for r in chosen):.1f}, bf16 {statistics.median(r[3] for r in chosen):.1f} "
                  f"tok/s, median ratio {statistics.median(r[2] / r[3] for r in chosen):.2f}x")


if __name__ == "__main__":
    main()
