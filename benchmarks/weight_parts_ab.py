"""Batch-1 decode with the layers' matrices as [num_layers, ...] stacks against the same in per-thread parts
(checkpoints.loading.load_model's weight_parts=0 and its default), paired round by round in one process.

Each round measures the memory's read bandwidth, then runs one greedy generation with each layout (in turns, the
order alternating), so the two share each moment of a machine whose bandwidth moves; rounds are also summarised
by the bandwidth read before them (the fast state: above 50 GB/s).

    python benchmarks/weight_parts_ab.py --model ~/.cache/jserve/bench-135m --dtype bfloat16 --rounds 200

--batch N generates N sequences at once instead (output tokens per second of the whole batch), where the matmuls
take many rows and both layouts run the same items over the same blocks.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from pathlib import Path

import checkpoints.loading
import cpu_kernels
import jserve.engine.engine
from jserve import LLM, SamplingParams


def load(model: str, dtype: str, weight_parts: int | None) -> LLM:
    """An LLM whose loader lays the matrices out with this weight_parts (the engine has no option for it)."""
    jserve.engine.engine.load_model = functools.partial(checkpoints.loading.load_model, weight_parts=weight_parts)
    try:
        return LLM(model, dtype=dtype)
    finally:
        jserve.engine.engine.load_model = checkpoints.loading.load_model


def summary(name: str, ratios: list[float], stacks: list[float], parts: list[float]) -> str:
    if not ratios:
        return f"{name}: no rounds"
    return (f"{name}: {len(ratios)} rounds, parts/stacks median {statistics.median(ratios):.3f} "
            f"({sum(r > 1 for r in ratios)} faster); median tok/s stacks {statistics.median(stacks):.1f}, "
            f"parts {statistics.median(parts):.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(Path("~/.cache/jserve/bench-135m").expanduser()))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()

    llms = {"stacks": load(args.model, args.dtype, 0), "parts": load(args.model, args.dtype, None)}
    if llms["parts"].engine.runner.layer_stack.matrix_parts is None:
        raise SystemExit("the model's matrices were not laid out in parts (the CPU kernels do not pack them here)")
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0.0)
    prompts = [f"hello world {i}" for i in range(args.batch)]
    tokens = {name: [o.outputs[0].token_ids for o in llm.generate(prompts, params)] for name, llm in llms.items()}
    print(f"same tokens: {tokens['stacks'] == tokens['parts']}", flush=True)
    rows = []  # (bandwidth GB/s, stacks tok/s, parts tok/s)
    for i in range(args.rounds):
        bandwidth = cpu_kernels.read_bandwidth(256 << 20, repeats=2) / 1e9
        speed = {}
        for name in ("stacks", "parts") if i % 2 == 0 else ("parts", "stacks"):
            start = time.perf_counter()
            llms[name].generate(prompts, params)
            speed[name] = args.batch * (args.tokens - 1) / (time.perf_counter() - start)
        rows.append((bandwidth, speed["stacks"], speed["parts"]))
        print(f"{bandwidth:5.1f} GB/s  stacks {speed['stacks']:6.1f}  parts {speed['parts']:6.1f} tok/s  "
              f"{speed['parts'] / speed['stacks']:.3f}", flush=True)
    for name, keep in (("all", lambda bw: True), ("fast state (> 50 GB/s)", lambda bw: bw > 50),
                       ("slow state (<= 45 GB/s)", lambda bw: bw <= 45)):
        chosen = [row for row in rows if keep(row[0])]
        print(summary(name, [p / s for _, s, p in chosen], [s for _, s, _ in chosen], [p for *_, p in chosen]))


if __name__ == "__main__":
    main()
