"""Section decode: where batch-1 decode time goes.

One engine on the speed section's model runs one request of 128 + N tokens under several settings in turn, each
measured on its second run: the steps a decode burst holds (decode_burst) and the smallest token bucket (a lone
decode padded to 8 rows, as on CPU, or run as 1). Both are changed on the live engine (its scheduler's burst length,
its executor's bucket list), so the weights load once and only the burst shapes a setting needs compile. Each row
splits the engine calls' time into the host's work and the wait for the device. The gemm section times each weight
matrix alone.
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

from benchmarks.gpu_check.common import model_dir, section_args, work_dir
from benchmarks.gpu_check.speed import run_requests, step_bytes, step_split

# (decode_burst, smallest token bucket) per variant; burst32_rows8 is the engine's default on a GPU. A lone decode
# run at 1 row took 19.9 ms a token on an H200 against 5.0 at 8 rows, so the rows1 variants are not run by default.
VARIANTS = {"burst8_rows8": (8, 8), "burst32_rows8": (32, 8), "burst32_rows1": (32, 1), "burst64_rows1": (64, 1)}
DEFAULT_VARIANTS = ["burst8_rows8", "burst32_rows8"]


def set_variant(engine, decode_burst: int, smallest_bucket: int) -> None:
    engine.config = dataclasses.replace(engine.config, decode_burst=decode_burst)
    engine.scheduler.decode_burst = decode_burst
    buckets = engine.executor.token_buckets  # the scheduler's burst buckets are this same list
    buckets[:] = sorted({b for b in buckets if b >= smallest_bucket} | {smallest_bucket})


def engine_settings(args: dict, load_format: str, on_gpu: bool, prompt: int, new_tokens: int) -> dict:
    """The LLM's settings for batch-1 decode of prompt + new_tokens tokens (the profile section's too)."""
    return dict(dtype=args.get("dtype", "bfloat16"), load_format=load_format,
                attention_backend="pallas" if on_gpu else args.get("cpu_backend", "auto"),
                executor="xla", max_model_len=-(-(prompt + 2 * new_tokens + 64) // 16) * 16, max_num_seqs=8,
                max_num_batched_tokens=256, kv_cache_memory_bytes=(4 << 30) if on_gpu else (64 << 20),
                compilation_cache_dir="", quantization=args.get("quantization"))


def main() -> None:
    import jax

    from jserve import LLM

    args, results = section_args()
    on_gpu = jax.default_backend() == "gpu"
    path, load_format = model_dir(args["model"], work_dir())
    prompt, new_tokens = 128, int(args.get("decode_tokens", 256))
    settings = engine_settings(args, load_format, on_gpu, prompt, new_tokens)
    results.record("settings", {**settings, "model": args["model"], "xla_flags": os.environ.get("XLA_FLAGS", "")})
    llm = LLM(str(path), warmup=False, **settings)
    engine = llm.engine
    bytes_per_token = step_bytes(engine, prompt + new_tokens / 2)
    bandwidth = args.get("hbm_gb_per_s")
    rng = np.random.default_rng(0)
    vocab = min(engine.model_config.vocab_size, 32000)
    names = args.get("decode_variants") or DEFAULT_VARIANTS
    # The same prompts for every variant: the measured run's tokens are compared with the first variant's.
    cold_prompt, prompt_ids = (rng.integers(10, vocab, (1, prompt)).tolist() for _ in range(2))
    first_tokens = None
    for name in names:
        set_variant(engine, *VARIANTS[name])
        cold_start = time.perf_counter()
        run_requests(llm, cold_prompt, new_tokens)
        cold = time.perf_counter() - cold_start
        before = dataclasses.replace(engine.stats)
        outputs, _ = run_requests(llm, prompt_ids, new_tokens)
        tokens = list(outputs[0].outputs[0].token_ids)
        first_tokens = first_tokens or tokens
        agreement = sum(a == b for a, b in zip(tokens, first_tokens, strict=True)) / max(len(first_tokens), 1)
        m = outputs[0].metrics
        tok_s = (new_tokens - 1) / (m["finished_time"] - m["first_token_time"])
        split = step_split(before, engine.stats)
        # The device's time a token: the calls' waits over their steps (the prompt's step is one call of one step).
        device_ms = split["device_wait_ms_per_call"] * split["engine_calls"] / max(split["model_steps"], 1)
        entry = {"variant": name, "decode_burst": VARIANTS[name][0], "smallest_bucket": VARIANTS[name][1],
                 "tok_s": tok_s, "ms_per_token": 1e3 / tok_s, "device_ms_per_step": device_ms,
                 "cold_seconds": cold, "tokens_equal_first_variant": agreement, **split}
        if bandwidth:
            floor_ms = bytes_per_token / (bandwidth * 1e9) * 1e3
            entry.update(roofline_ms=floor_ms, share_of_roofline=floor_ms * tok_s / 1e3)
        results.append("variants", entry)


if __name__ == "__main__":
    main()
