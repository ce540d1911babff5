"""Where the host's time goes in a decode step of many sequences: each engine function wrapped in a timer.

    python benchmarks/host_profile.py [--model DIR] [--dtype bfloat16] [--num-seqs 32] [--decode-burst 1]
                                      [--final-only]

Runs --num-seqs requests of 128 random prompt tokens, each decoding 64 tokens greedily, after a short untimed round,
and reports per decode-only engine step (every scheduled sequence decoding): the step's wall time, the time it
waited for the device's results, and the host time of each engine function. With --decode-burst N (the engine's
default is 8) an engine step runs up to N decode steps in one device call, so it also reports the host's work per
decode step, the figure a token's latency pays. It measures the `jserve` found first on the path:
`PYTHONPATH=. python benchmarks/host_profile.py` this checkout, `PYTHONPATH=/tmp/base` another one. The wrappers
themselves add ~1 us a call.
"""

from __future__ import annotations

import argparse
import collections
import functools
import time
from pathlib import Path

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(Path("~/.cache/jserve/bench-135m").expanduser()))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--decode-burst", type=int, default=1)
    parser.add_argument("--final-only", action="store_true",
                        help="report each request once, finished, as LLM.generate and `jserve generate` do "
                             "(default: after every step, as the server does)")
    args = parser.parse_args()

    import jserve.engine.engine as engine_module
    import jserve.engine.scheduler as scheduler_module
    import jserve.executors.xla as xla_module
    from jserve.llm import LLM
    from jserve.sampling_params import SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, decode_burst=args.decode_burst, max_num_seqs=args.num_seqs,
              max_model_len=1024, kv_cache_memory_bytes=300 << 20)
    engine = llm.engine
    seconds: dict[str, float] = collections.defaultdict(float)
    cpu_seconds: dict[str, float] = collections.defaultdict(float)  # the engine thread's own CPU time

    def wrap(owner, name: str, label: str) -> None:
        if not hasattr(owner, name):  # an engine of another version
            return
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def timed(*a, **k):
            start, cpu_start = time.perf_counter(), time.thread_time()
            try:
                return inner(*a, **k)
            finally:
                seconds[label] += time.perf_counter() - start
                cpu_seconds[label] += time.thread_time() - cpu_start

        setattr(owner, name, timed)

    timed_functions = [
        (engine.scheduler, "schedule", "schedule"), (engine.executor, "prepare", "build the batch"),
        (engine.executor, "run", "dispatch forward"), (engine.executor, "execute_burst", "dispatch forward + sample"),
        (engine._metadata, "build", "sampling metadata"), (xla_module, "sample_packed", "dispatch sample"),
        (engine.outputs, "append", "append and detokenize"), (engine.outputs, "emit", "outputs"),
        (engine.scheduler, "update", "mark computed")]
    for owner, name, label in timed_functions:
        wrap(owner, name, label)
    waited = [0.0]
    real_asarray = np.asarray

    class TimedNumpy:  # the engine's one blocking read of each step is its np.asarray of the sampled tokens
        def __getattr__(self, name):
            return getattr(np, name)

        @staticmethod
        def asarray(a, *rest, **kwargs):
            start = time.perf_counter()
            try:
                return real_asarray(a, *rest, **kwargs)
            finally:
                waited[0] += time.perf_counter() - start

    engine_module.np = TimedNumpy()
    rng = np.random.default_rng(0)
    kind = {}
    if args.final_only:
        from jserve.sampling_params import RequestOutputKind

        kind = {"output_kind": RequestOutputKind.FINAL_ONLY}

    def run_round(tag: str, max_tokens: int) -> list[tuple[float, float, dict[str, float]]]:
        for i in range(args.num_seqs):
            engine.add_request(f"{tag}{i}", {"prompt_token_ids": rng.integers(100, 40000, 128).tolist()},
                               SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kind))
        steps = []
        while engine.has_unfinished_requests():
            before, cpu_before = dict(seconds), dict(cpu_seconds)
            waited_before, device_steps = waited[0], engine.stats.num_steps
            start, cpu_start = time.perf_counter(), time.thread_time()
            engine.step()
            cpu = time.thread_time() - cpu_start
            decode_only = bool(plans) and all(scheduler_module._is_decode(c) for c in plans[-1].scheduled)
            if decode_only and len(plans[-1].scheduled) == args.num_seqs:
                steps.append((time.perf_counter() - start, waited[0] - waited_before,
                              {k: v - before.get(k, 0.0) for k, v in seconds.items()},
                              engine.stats.num_steps - device_steps, cpu,
                              {k: v - cpu_before.get(k, 0.0) for k, v in cpu_seconds.items()}))
        return steps

    plans = []
    schedule = engine.scheduler.schedule

    def recording_schedule(*a, **k):
        plans.append(schedule(*a, **k))
        return plans[-1]

    engine.scheduler.schedule = recording_schedule
    run_round("warm", 8)
    steps = run_round("timed", 64)
    n, decode_steps = len(steps), sum(s[3] for s in steps)
    wall, wait = sum(s[0] for s in steps) / n, sum(s[1] for s in steps) / n
    print(f"{args.dtype}, {args.num_seqs} sequences, {n} decode-only engine steps ({decode_steps / n:.2f} decode steps "
          f"each): {wall * 1e3:.1f} ms an engine step, {wait * 1e3:.1f} ms of it waiting for the device")
    # Means and medians: once the step is launched its threads take both cores of a small machine, and a dispatch
    # the scheduler preempts before it returns counts ~5 ms here, though the device is already at work.
    print(f"  {'':28s} {'mean':>9s} {'median':>9s} {'CPU median':>11s}")
    for label in sorted({k for s in steps for k in s[2]}):
        times = [s[2].get(label, 0.0) for s in steps]
        cpu_times = [s[5].get(label, 0.0) for s in steps]
        print(f"  {label:28s} {np.mean(times) * 1e3:6.3f} ms {np.median(times) * 1e3:6.3f} ms "
              f"{np.median(cpu_times) * 1e3:8.3f} ms")
    host = [s[0] - s[1] for s in steps]
    print(f"host work per engine step (wall less the wait): {np.mean(host) * 1e3:.3f} ms mean, "
          f"{np.median(host) * 1e3:.3f} ms median; per decode step: {np.mean(host) * n / decode_steps * 1e3:.3f} ms "
          f"mean, {np.median(host) * n / decode_steps * 1e3:.3f} ms median")
    # The wall time counts the engine thread while the step's own threads hold both cores and it waits for one;
    # its CPU time is the work the host adds to a step on a machine whose cores the device shares.
    cpu = [s[4] for s in steps]
    print(f"engine thread CPU time per engine step: {np.mean(cpu) * 1e3:.3f} ms mean, {np.median(cpu) * 1e3:.3f} ms "
          f"median; per decode step: {np.median(cpu) * n / decode_steps * 1e3:.3f} ms median")


if __name__ == "__main__":
    main()
