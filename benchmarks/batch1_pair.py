"""Batch-1 decode of jserve and llama.cpp taken in turns, paired round by round, for machines whose memory
bandwidth moves while they run.

    python benchmarks/batch1_pair.py [--dtype bfloat16|float32] [--rounds 10] [--model DIR] [--llama-bin DIR]

jserve runs in this process (one 128-token prompt, 128 greedy tokens, as `jserve bench latency`); llama.cpp's
`llama-bench -p 0 -n 128 -t 2 -r 2` runs as a subprocess on the GGUF of the same weights, at the matched precision
(bf16 or f32). The order alternates between rounds, and each round starts with a read-bandwidth measurement. On a
shared machine the bandwidth can halve for minutes at a time; a ratio taken within one round compares the two under
the same conditions, where medians of separate runs need not.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
from pathlib import Path

import numpy as np

GGUF_SUFFIX = {"bfloat16": "bf16", "float32": "f32"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=sorted(GGUF_SUFFIX), default="bfloat16")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--model", type=Path, default=Path("~/.cache/jserve/bench-135m").expanduser())
    parser.add_argument("--llama-bin", type=Path, default=Path("~/.cache/jserve/llama.cpp/build/bin").expanduser())
    args = parser.parse_args()
    gguf = Path(f"{args.model}-{GGUF_SUFFIX[args.dtype]}.gguf")
    bench = args.llama_bin / "llama-bench"
    for needed in (args.model, gguf, bench):
        if not needed.exists():
            raise SystemExit(f"{needed} not found: build it as benchmarks/README.md describes")

    from jserve.bench.latency import time_request
    from jserve.bench.roofline import stream_bandwidth
    from jserve.llm import LLM

    llm = LLM(model=str(args.model), dtype=args.dtype, max_num_seqs=4, max_model_len=1024,
              kv_cache_memory_bytes=300 << 20)
    rng = np.random.default_rng(0)

    def jserve_rate(i: int) -> float:
        _, decode = time_request(llm.engine, f"pair-{i}", rng.integers(100, 40000, 128).tolist(), 128)
        return 127 / decode

    def llama_rate() -> float:
        out = subprocess.run([str(bench), "-m", str(gguf), "-p", "0", "-n", "128", "-t", "2", "-r", "2"],
                             capture_output=True, text=True, check=True,
                             env={**os.environ, "LD_LIBRARY_PATH": str(args.llama_bin)}).stdout
        return float(re.search(r"tg128 \|\s+([0-9.]+)", out).group(1))

    jserve_rate(-1)  # untimed: the first request's Python paths
    rows = []
    for i in range(args.rounds):
        bandwidth = stream_bandwidth() / 1e9
        if i % 2 == 0:
            ours = jserve_rate(i)
            theirs = llama_rate()
        else:
            theirs = llama_rate()
            ours = jserve_rate(i)
        rows.append((bandwidth, ours, theirs))
        print(f"round {i}: {bandwidth:.1f} GB/s read bandwidth, jserve {ours:.1f} tok/s, llama.cpp {theirs:.1f}, "
              f"ratio {ours / theirs:.3f}", flush=True)
    ratios = [ours / theirs for _, ours, theirs in rows]
    print(f"{args.dtype}: median jserve {statistics.median(r[1] for r in rows):.1f} tok/s, llama.cpp "
          f"{statistics.median(r[2] for r in rows):.1f}; paired ratio median {statistics.median(ratios):.3f}, "
          f"jserve faster in {sum(r > 1 for r in ratios)} of {len(ratios)} rounds")


if __name__ == "__main__":
    main()
