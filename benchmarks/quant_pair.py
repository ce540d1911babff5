"""Batch-1 decode with int8 weights against bfloat16, both engines in one process taking turns, paired round by
round, for machines whose memory bandwidth moves while they run; llama.cpp's on its bf16, Q8_0 and Q4_1 files beside.

    python benchmarks/quant_pair.py [--rounds 12] [--model DIR] [--load-format dummy] [--output-len 128]
                                    [--llama-bin DIR] [--also-decode-burst N]

Each round measures the read bandwidth, then runs one request (a 32-token prompt, greedy tokens, as `jserve bench
latency` times it) on each engine, the order alternating, and where MODEL-bf16.gguf, MODEL-Q8_0.gguf and
MODEL-Q4_1.gguf lie beside the model (benchmarks/README.md makes them) and llama-bench is built, `llama-bench -p 0
-n OUTPUT_LEN -t 2 -r 1` on each file. A round whose bandwidth reads alike before and after compares them under one
memory state; the summary gives the medians and the median ratios of such rounds for each state. With
--also-decode-burst N, both engines also run at decode_burst N (named "int8 bN", "bf16 bN") beside the default's.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
from pathlib import Path

FAST_GBPS = 50.0  # the bandwidth that splits the rounds into the memory's two states on the 2-core EPYC
LLAMA_FILES = ("bf16", "Q8_0", "Q4_1")  # llama.cpp's runs: MODEL-<name>.gguf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--model", type=Path, default=Path("~/.cache/jserve/bench-135m").expanduser())
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--executor", default="cpu-layers")
    parser.add_argument("--llama-bin", type=Path, default=Path("~/.cache/jserve/llama.cpp/build/bin").expanduser())
    parser.add_argument("--also-decode-burst", type=int, default=None,
                        help="also run both engines at this decode_burst, paired with the default's")
    args = parser.parse_args()

    from jserve.bench.latency import time_request
    from jserve.bench.roofline import stream_bandwidth
    from jserve.llm import LLM

    ggufs = {name: Path(f"{args.model}-{name}.gguf") for name in LLAMA_FILES}
    bench = args.llama_bin / "llama-bench"
    if not bench.is_file() or not all(path.is_file() for path in ggufs.values()):
        print(f"llama.cpp left out: {bench} or one of {[str(p) for p in ggufs.values()]} is missing")
        ggufs = {}

    def llama_rate(gguf: Path) -> float:
        out = subprocess.run([str(bench), "-m", str(gguf), "-p", "0", "-n", str(args.output_len), "-t", "2",
                              "-r", "1"], capture_output=True, text=True, check=True,
                             env={**os.environ, "LD_LIBRARY_PATH": str(args.llama_bin)}).stdout
        return float(re.search(rf"tg{args.output_len} \|\s+([0-9.]+)", out).group(1))

    bursts = {"": {}} | ({f" b{args.also_decode_burst}": {"decode_burst": args.also_decode_burst}}
                         if args.also_decode_burst else {})
    engines = {name + suffix: LLM(model=str(args.model), dtype="bfloat16", quantization=quantization,
                                  executor=args.executor, load_format=args.load_format, max_num_seqs=4,
                                  max_model_len=512, kv_cache_memory_bytes=64 << 20, **burst).engine
               for suffix, burst in bursts.items() for name, quantization in (("int8", "int8"), ("bf16", None))}
    prompt = list(range(100, 132))
    for engine in engines.values():
        time_request(engine, "warm", prompt, 8)  # untimed: the first request's Python paths
    runs = [*engines, *(f"llama {name}" for name in ggufs)]
    rows = []
    for i in range(args.rounds):
        before = stream_bandwidth(128 << 20) / 1e9
        rates = {}
        for name in runs if i % 2 else runs[::-1]:
            if name in engines:
                _, decode = time_request(engines[name], f"pair-{i}", prompt, args.output_len)
                rates[name] = (args.output_len - 1) / decode
            else:
                rates[name] = llama_rate(ggufs[name.removeprefix("llama ")])
        after = stream_bandwidth(128 << 20) / 1e9
        rows.append((before, after, rates))
        print(f"round {i}: {before:.0f} -> {after:.0f} GB/s  " + "  ".join(f"{n} {rates[n]:.1f}" for n in runs)
              + f" tok/s  int8/bf16 {rates['int8'] / rates['bf16']:.2f}x", flush=True)
    ratios = {"int8 / bf16": ("int8", "bf16")}
    for suffix in list(bursts)[1:]:
        ratios |= {f"int8{suffix} / bf16{suffix}": (f"int8{suffix}", f"bf16{suffix}"),
                   f"int8 / int8{suffix}": ("int8", f"int8{suffix}"), f"bf16 / bf16{suffix}": ("bf16", f"bf16{suffix}")}
    if ggufs:
        ratios |= {"llama Q8_0 / bf16": ("llama Q8_0", "llama bf16"), "llama Q4_1 / bf16": ("llama Q4_1", "llama bf16"),
                   "int8 / llama Q8_0": ("int8", "llama Q8_0")}
    for state, alike in (("fast", lambda b, a: b > FAST_GBPS and a > FAST_GBPS),
                         ("slow", lambda b, a: b < FAST_GBPS and a < FAST_GBPS)):
        chosen = [r for b, a, r in rows if alike(b, a)]
        if not chosen:
            continue
        bandwidth = statistics.median(b for b, a, _ in rows if alike(b, a))
        medians = ", ".join(f"{n} {statistics.median(r[n] for r in chosen):.1f}" for n in runs)
        paired = ", ".join(f"{label} {statistics.median(r[x] / r[y] for r in chosen):.2f}x"
                           for label, (x, y) in ratios.items())
        print(f"{state} memory ({len(chosen)} rounds, {bandwidth:.0f} GB/s): {medians} tok/s; median ratios: {paired}")


if __name__ == "__main__":
    main()
