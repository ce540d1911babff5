"""The batch-1 roofline's share against two read buffers, in one process: before each timed request, the memory's
read bandwidth over a fixed 256 MiB (jserve bench latency's buffer before the twenty-first session) and over as many
bytes as a decode token reads (its buffer since: jserve.bench.roofline.stream_buffer_bytes), the two reads' order
alternating.

    python benchmarks/roofline_buffer.py --model ~/.cache/jserve/bench-135m --dtype bfloat16 --iters 8
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np

from jserve.bench.datasets import ordinary_token_ids, random_prompt
from jserve.bench.latency import mean_context, time_request
from jserve.bench.roofline import decode_bytes_per_token, last_level_cache_bytes, stream_bandwidth, stream_buffer_bytes
from jserve.llm import LLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(Path("~/.cache/jserve/bench-135m").expanduser()))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()

    engine = LLM(model=args.model, dtype=args.dtype).engine
    rng = np.random.default_rng(0)
    vocab = ordinary_token_ids(engine.tokenizer, engine.tokenizer.special_token_ids)
    per_token = decode_bytes_per_token(engine.model_config, args.dtype, mean_context(args.input_len, args.output_len))
    sized = stream_buffer_bytes(per_token, last_level_cache_bytes())
    print(f"{per_token / 1e6:.1f} MB a token; buffers 256 MiB and {sized >> 20} MiB")
    time_request(engine, "warm", random_prompt(rng, vocab, args.input_len), args.output_len)
    shares: dict[int, list[float]] = {256 << 20: [], sized: []}
    for i in range(args.iters):
        order = [256 << 20, sized] if i % 2 == 0 else [sized, 256 << 20]
        bandwidth = {size: stream_bandwidth(size) for size in order}
        _, decode = time_request(engine, f"r{i}", random_prompt(rng, vocab, args.input_len), args.output_len)
        tokens_per_s = (args.output_len - 1) / decode
        for size, bw in bandwidth.items():
            shares[size].append(tokens_per_s / (bw / per_token))
        print(f"{tokens_per_s:6.1f} tok/s; " + ", ".join(
            f"{size >> 20} MiB {bandwidth[size] / 1e9:.1f} GB/s, share {shares[size][-1]:.3f}" for size in shares),
            flush=True)
    print("median share: " + ", ".join(f"{size >> 20} MiB {statistics.median(s):.3f}" for size, s in shares.items()))


if __name__ == "__main__":
    main()
