"""Generations that end on a stop token inside a decode burst: the burst ending on the device once every sequence
in it has stopped, against the same bursts run to their full length (as before), paired round by round in one
process.

--stops prompts each get a greedy generation of --tokens, and each a stop token: one that appears there for the
first time at the position nearest its share of an even spread over the generation, so a request with that token
in stop_token_ids ends right after it. Each round runs every such request (--batch of them at a time) in both
modes, in turns, the order alternating, and prints both modes' wall time and engine steps; the summary gives the
median ratio of the rounds' times.

    python benchmarks/burst_stop.py --model ~/.cache/jserve/bench-135m --dtype bfloat16 --rounds 20
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import jserve.engine.engine as engine_module
from jserve import LLM, SamplingParams
from jserve.engine.runner import no_stop_ids


def stop_position(tokens: list[int], target: int) -> int:
    """The position nearest `target` (before the last) whose token appears in `tokens` for the first time."""
    firsts = [i for i in range(1, len(tokens) - 1) if tokens[i] not in tokens[:i]]
    if not firsts:
        raise SystemExit("a generation repeats one token: no stop token to pick")
    return min(firsts, key=lambda i: abs(i - target))


def run(llm: LLM, prompts: list[str], params: list[SamplingParams], batch: int, device_stop: bool
        ) -> tuple[float, int, list[list[int]]]:
    """-> (seconds, engine steps, each request's tokens) for every request, `batch` at a time."""
    stop_ids = engine_module._burst_stop_ids
    if not device_stop:  # every row without stop ids: the burst runs its full length, as before
        engine_module._burst_stop_ids = lambda seqs, rows: no_stop_ids(rows)
    try:
        steps, start, tokens = llm.engine.stats.num_steps, time.perf_counter(), []
        for i in range(0, len(params), batch):
            outs = llm.generate(prompts[i:i + batch], params[i:i + batch], use_tqdm=False)
            tokens += [o.outputs[0].token_ids for o in outs]
        return time.perf_counter() - start, llm.engine.stats.num_steps - steps, tokens
    finally:
        engine_module._burst_stop_ids = stop_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(Path("~/.cache/jserve/bench-135m").expanduser()))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--stops", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--decode-burst", type=int, default=None, help="default: the engine's")
    args = parser.parse_args()

    engine_args = {} if args.decode_burst is None else {"decode_burst": args.decode_burst}
    llm = LLM(args.model, dtype=args.dtype, **engine_args)
    prompts = [f"request {i}: a few words on topic number {i}" for i in range(args.stops)]
    greedy = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0.0)
    free = [out.outputs[0].token_ids for out in llm.generate(prompts, greedy, use_tqdm=False)]
    targets = [round(4 + i * (args.tokens - 8) / max(1, args.stops - 1)) for i in range(args.stops)]
    positions = [stop_position(tokens, target) for tokens, target in zip(free, targets, strict=True)]
    params = [greedy.clone(stop_token_ids=[tokens[p]]) for tokens, p in zip(free, positions, strict=True)]
    print(f"decode_burst {llm.engine.config.decode_burst}; stops after tokens {[p + 1 for p in positions]}; "
          f"{sum(positions) + len(positions)} tokens a round", flush=True)
    modes = {"device stop": True, "full bursts": False}
    for device_stop in modes.values():  # warm both (the first generation of a batch size times its step)
        run(llm, prompts, params, args.batch, device_stop)
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    for r in range(args.rounds):
        row = {}
        for mode in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
            took, steps, tokens = run(llm, prompts, params, args.batch, modes[mode])
            if tokens != [f[:p + 1] for f, p in zip(free, positions, strict=True)]:
                raise SystemExit(f"{mode}: the generations do not end at their stop tokens")
            seconds[mode].append(took)
            row[mode] = f"{mode} {took * 1e3:7.1f} ms, {steps} steps"
        print("; ".join(row[mode] for mode in modes), flush=True)
    ratios = [full / stop for stop, full in zip(seconds["device stop"], seconds["full bursts"], strict=True)]
    print(f"{args.rounds} rounds: full bursts / device stop time, median {statistics.median(ratios):.3f} "
          f"(device stop faster in {sum(r > 1 for r in ratios)}); median ms a round: device stop "
          f"{statistics.median(seconds['device stop']) * 1e3:.1f}, full bursts "
          f"{statistics.median(seconds['full bursts']) * 1e3:.1f}")


if __name__ == "__main__":
    main()
