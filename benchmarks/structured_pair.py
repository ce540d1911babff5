"""Structured outputs against free generation on one engine, in turns: N concurrent requests of random prompts, every
one asking for JSON of jserve.bench.serve.BENCH_SCHEMA (or nothing), output tokens/s and the host's time filling
token masks per step (EngineStats.grammar_mask_seconds).

    PYTHONPATH=. python benchmarks/structured_pair.py --model ~/.cache/jserve/bench-135m [--dtype bfloat16]
        [--concurrency 32] [--input-len 128] [--output-len 128] [--rounds 2]

Each request ignores EOS, so both runs generate the same number of tokens: once a constrained output completes its
JSON, its mask allows only EOS, which it then takes until max_tokens (the mask is still filled every step).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

from jserve import LLM, SamplingParams
from jserve.bench.serve import BENCH_SCHEMA


def run(llm: LLM, prompts: list[list[int]], output_len: int, constrained: bool) -> dict:
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=output_len, ignore_eos=True,
                            structured_outputs={"json": BENCH_SCHEMA} if constrained else None)
    stats = llm.engine.stats
    before = dataclasses.replace(stats)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    steps = stats.num_engine_steps - before.num_engine_steps
    return {"output_tok_s": tokens / seconds, "engine_steps": steps,
            "mask_ms_per_step": 1e3 * (stats.grammar_mask_seconds - before.grammar_mask_seconds) / max(steps, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.concurrency,
              max_model_len=args.input_len + args.output_len + 16)
    rng = np.random.default_rng(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = rng.integers(10, vocab - 10, (args.concurrency, args.input_len)).tolist()
    run(llm, prompts[:4], 8, True)  # compile what the constrained steps use (the sampler's mask variant)
    for round_ in range(args.rounds):
        free = run(llm, prompts, args.output_len, constrained=False)
        json_schema = run(llm, prompts, args.output_len, constrained=True)
        print(f"round {round_ + 1}: free {free['output_tok_s']:.1f} tok/s ({free['engine_steps']} engine steps), "
              f"json-schema {json_schema['output_tok_s']:.1f} tok/s ({json_schema['engine_steps']} engine steps, "
              f"{json_schema['mask_ms_per_step']:.2f} ms of mask filling a step): "
              f"{json_schema['output_tok_s'] / free['output_tok_s']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
