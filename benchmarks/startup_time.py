"""Start-up time of `LLM(...)` (load, compile with the persistent cache, warm-up) in fresh processes, checkouts
alternating, each process timing itself.

    python benchmarks/startup_time.py [--model DIR] [--rounds 3] CHECKOUT [CHECKOUT ...]

Each CHECKOUT is put first on PYTHONPATH (this checkout: `.`; another: `git worktree add /tmp/base <commit>`).
The compile cache is filled by an untimed first process, so every timed one compiles nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import gc, json, sys, time
start = time.perf_counter()
from jserve import LLM
imported = time.perf_counter()
LLM(model=sys.argv[1], dtype="bfloat16", max_num_seqs=32, max_model_len=1024, compilation_cache_dir=sys.argv[2])
done = time.perf_counter()
print(json.dumps({"import_s": imported - start, "llm_s": done - imported,
                  "full_collections": gc.get_stats()[2]["collections"]}))
"""


def run_child(checkout: str, model: str, cache: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(checkout)}
    out = subprocess.run([sys.executable, "-c", CHILD, model, cache], env=env, capture_output=True, text=True,
                         check=True, cwd=tempfile.gettempdir())
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkouts", nargs="+")
    parser.add_argument("--model", default=str(Path("~/.cache/jserve/bench-135m").expanduser()))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        run_child(args.checkouts[0], args.model, cache)  # fills the compile cache
        times: dict[str, list[dict]] = {c: [] for c in args.checkouts}
        for r in range(args.rounds):
            for checkout in args.checkouts if r % 2 == 0 else args.checkouts[::-1]:
                times[checkout].append(run_child(checkout, args.model, cache))
    for checkout, runs in times.items():
        llm = [run["llm_s"] for run in runs]
        print(f"{checkout}: LLM() {statistics.median(llm):.2f} s median ({', '.join(f'{t:.2f}' for t in llm)}), "
              f"import {statistics.median(run['import_s'] for run in runs):.2f} s, "
              f"{runs[-1]['full_collections']} full collections in the process")


if __name__ == "__main__":
    main()
