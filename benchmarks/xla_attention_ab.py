"""The XLA path's attention, side by side in one run: the engine's chunked pure-JAX attention (one full-width page
table, decode bursts) against the dense gather it replaced (each token gathers its sequence's whole page-table row,
so the width is bucketed by powers of two and decodes step singly). Each variant runs in its own process.

    python benchmarks/xla_attention_ab.py [--model DIR] [--dtype float32|bfloat16] [--rounds 2]

Prints each variant's cold warm-up (step shapes, bursts, seconds) and the best of `rounds` timed runs of four
offline workloads (requests x input/output tokens), greedy.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKLOADS = [(1, 128, 128), (16, 128, 64), (32, 512, 32), (8, 900, 16)]


def variant(name: str, model: str, dtype: str, rounds: int) -> dict:
    import numpy as np

    import jserve.engine.runner as runner
    import pallas_kernels.interface as interface
    from jserve import LLM, SamplingParams
    from pallas_kernels.reference import ragged_paged_attention_ref

    if name == "dense-gather":
        interface.ragged_paged_attention_chunked = lambda *a, pages_per_chunk=None, **k: ragged_paged_attention_ref(
            *a, **k)
        runner.reads_only_used_pages = lambda backend, platform=None: backend == "cpu"
    llm = LLM(model, attention_backend="reference", dtype=dtype, compilation_cache_dir="", max_model_len=1024)
    stats = llm.engine.stats
    result = {"variant": name, "warmup_s": stats.warmup_seconds, "step_shapes": stats.warmup_step_shapes,
              "burst_shapes": stats.warmup_burst_shapes, "workloads": []}
    rng = np.random.default_rng(0)
    for n, in_len, out_len in WORKLOADS:
        params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
        best = float("inf")
        for _ in range(rounds + 1):  # the first run is untimed
            prompts = [{"prompt_token_ids": rng.integers(5, 4000, in_len).tolist()} for _ in range(n)]
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            best = min(best, time.perf_counter() - start)
        result["workloads"].append({"requests": n, "input": in_len, "output": out_len, "seconds": best,
                                    "output_tok_s": n * out_len / best})
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the bundled demo model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # set in the child processes
    args = parser.parse_args()
    if args.model is None:
        from checkpoints import DEMO_MODEL_DIR

        args.model = str(DEMO_MODEL_DIR)
    if args.variant:
        print(json.dumps(variant(args.variant, args.model, args.dtype, args.rounds)))
        return 0
    results = []
    for name in ("chunked", "dense-gather"):
        cmd = [sys.executable, __file__, "--variant", name, "--model", args.model, "--dtype", args.dtype,
               "--rounds", str(args.rounds)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    print("| variant | warm-up s | step shapes + bursts | " +
          " | ".join(f"{n}x{i}/{o} tok/s" for n, i, o in WORKLOADS) + " |")
    print("|---|---|---|" + "---|" * len(WORKLOADS))
    for r in results:
        print(f"| {r['variant']} | {r['warmup_s']:.1f} | {r['step_shapes']} + {r['burst_shapes']} | " +
              " | ".join(f"{w['output_tok_s']:.0f}" for w in r["workloads"]) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
