"""Section quant: weight and KV-cache quantization on the decode section's model, one engine per setting.

Each setting (bf16 weights, the reference; int8 / fp8 weights; int8 / fp8 KV cache; optionally float32 weights as
the yardstick of plain rounding) loads its own engine, runs the same prompts, then is freed before the next:

- correctness against bf16: the first step's logits of 4 random 32-token prompts (one prefill step of the engine's
  executor, every vocabulary entry) as the max abs difference and whether each prompt's argmax is the same; then
  those prompts' greedy tokens (32 new each) as the share before each stream's first divergence and the streams
  identical. With dummy random weights the argmax margins are tiny, so greedy agreement is only loosely informative:
  the float32 row shows what rounding alone does.
- speed: batch-1 decode of one 128-token prompt + N new tokens, measured on its second run (the first compiles), and
  the bytes a decode token reads (every weight but an untied embedding table, scales included, plus its K/V) against
  the HBM bandwidth the env section measured.

The *_cublas and *_untuned settings load the same weights as int8 / fp8 but compile the steps with other XLA options
(COMPILER_OPTIONS) than the engine's autotuned Triton GEMM: cuBLAS, which cannot fuse the weight's convert into the
dot, or the Triton GEMM's default tiles.

fp8 (float8_e4m3fn) weights and KV, and the Triton GEMM settings, are refused off a GPU: there they are recorded as
skipped. The KV settings run
before the weight ones by default: with dummy weights a quantized setting draws them on the device, then quantizes
them on the host at load (about a minute for the 8B shape), so under the section's time limit the cheap rows come
first. The prompts' 4 x 32 tokens make one prefill step of the speed prompt's 128 tokens: on a GPU (one full-width
page table) the speed run then reuses the correctness run's executables.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
import traceback
from collections.abc import Iterator

import numpy as np

from benchmarks.gpu_check.common import model_dir, section_args, work_dir
from benchmarks.gpu_check.decode import engine_settings
from benchmarks.gpu_check.speed import param_bytes, run_requests, step_bytes, step_split

# name: LLM settings on top of the decode section's (dtype bfloat16)
SETTINGS = {"bf16": {}, "int8": {"quantization": "int8"}, "fp8": {"quantization": "fp8"},
            "kv_int8": {"kv_cache_dtype": "int8"}, "kv_fp8": {"kv_cache_dtype": "fp8"},
            "int8_kv_int8": {"quantization": "int8", "kv_cache_dtype": "int8"}, "f32": {"dtype": "float32"}}
# Settings that compile the engine's steps with other XLA options than executors.xla.step_compiler_options gives
# them (quantized weights: XLA's Triton GEMM, autotuned per shape). On cuBLAS, which multiplies bf16 by bf16, each
# step writes a bf16 copy of every int8 / fp8 weight and reads it back; the Triton GEMM converts the 1-byte weight
# in registers, and without autotuning its default tiles are slow for batch-1 shapes.
CUBLAS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0}
COMPILER_OPTIONS = {"int8_cublas": CUBLAS, "fp8_cublas": CUBLAS,
                    "int8_triton_gemm_untuned": {"xla_gpu_enable_triton_gemm": True, "xla_gpu_autotune_level": 0}}
SETTINGS.update({name: SETTINGS[name.split("_")[0]] for name in COMPILER_OPTIONS})
GPU_ONLY = {"fp8", "kv_fp8", *COMPILER_OPTIONS}
DEFAULT_SETTINGS = ["bf16", "kv_int8", "kv_fp8", "int8", "fp8", "int8_cublas"]
REFERENCE = "bf16"
SPEED_PROMPT = 128
PROMPTS, PROMPT_LEN, GREEDY_TOKENS = 4, SPEED_PROMPT // 4, 32


def first_step_logits(engine, prompts: list[list[int]]) -> np.ndarray:
    """float32 logits [prompts, vocab] of each prompt's last position, the prompts prefilled in one executor step
    (blocks from 0 up: the engine has served nothing yet, and its later requests overwrite them)."""
    from jserve.engine.sequence import ScheduledSeq, Sequence
    from jserve.sampling_params import SamplingParams

    runner, block_size = engine.executor, engine.config.block_size
    chunks, next_block = [], 0
    for p in prompts:
        seq = Sequence("quant", p, SamplingParams())
        needed = -(-len(p) // block_size)
        seq.block_table = list(range(next_block, next_block + needed))
        next_block += needed
        chunks.append(ScheduledSeq(seq, len(p), True))
    logits = np.asarray(runner.run(runner.prepare(chunks)), dtype=np.float32)
    return logits[:len(prompts)]


def agreement(reference: list[list[int]], tokens: list[list[int]]) -> dict:
    prefixes = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
                for x, y in zip(reference, tokens, strict=True)]
    total = sum(len(x) for x in reference)
    return {"tokens_before_first_divergence": sum(prefixes) / max(total, 1),
            "identical_streams": sum(p == len(x) for p, x in zip(prefixes, reference, strict=True)),
            "streams": len(reference)}


def device_bytes_in_use() -> int | None:
    import jax

    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # not every backend keeps them
        return None
    return stats.get("bytes_in_use")


@contextlib.contextmanager
def compiler_options(options: dict | None) -> Iterator[None]:
    """While an engine is built: its steps and bursts compile with these XLA options (bursts keep their command
    buffers) instead of the executor's own."""
    from jserve.executors import xla

    if not options:
        yield
        return
    step, burst = xla.step_compiler_options, xla.burst_compiler_options
    xla.step_compiler_options = lambda platform, quantized_weights=False: options
    xla.burst_compiler_options = lambda platform, quantized_weights=False: {**(burst(platform) or {}), **options}
    try:
        yield
    finally:
        xla.step_compiler_options, xla.burst_compiler_options = step, burst


def main() -> None:
    import jax
    from jax._src import dispatch

    from jserve import LLM
    from jserve.executors.xla import kv_bytes_per_block

    args, results = section_args()
    on_gpu = jax.default_backend() == "gpu"
    path, load_format = model_dir(args["model"], work_dir())
    new_tokens = int(args.get("decode_tokens", 256))
    base = engine_settings(args, load_format, on_gpu, SPEED_PROMPT, new_tokens)
    names = args.get("quant_settings") or DEFAULT_SETTINGS
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        raise SystemExit(f"unknown quant settings {unknown}; expected some of {list(SETTINGS)}")
    names = [REFERENCE, *[n for n in names if n != REFERENCE]]  # the reference first, always
    results.record("settings", {**base, "model": args["model"], "settings": names, "prompts": PROMPTS,
                                "prompt_len": PROMPT_LEN, "greedy_tokens": GREEDY_TOKENS,
                                "speed_prompt": SPEED_PROMPT, "new_tokens": new_tokens})
    bandwidth = args.get("hbm_gb_per_s")
    compiles: list[str] = []  # in the measured decode run (there should be none)
    counting = [False]
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.append(event)
        if counting[0] and event == dispatch.BACKEND_COMPILE_EVENT else None)
    reference: dict = {}
    for name in names:
        entry: dict = {"setting": name, **SETTINGS[name], "compiler_options": COMPILER_OPTIONS.get(name)}
        if name in GPU_ONLY and not on_gpu:
            results.append("rows", {**entry, "status": "skipped: GPU only"})
            continue
        llm = engine = None
        try:
            start = time.perf_counter()
            with compiler_options(COMPILER_OPTIONS.get(name)):
                llm = LLM(str(path), warmup=False, **{**base, "quantization": None, **SETTINGS[name]})
            engine = llm.engine
            jax.block_until_ready(engine.executor.params)
            entry["load_seconds"] = time.perf_counter() - start
            entry["device_bytes_in_use_loaded"] = device_bytes_in_use()
            cfg = engine.model_config
            vocab = min(cfg.vocab_size, 32000)
            # The same prompts for every setting (a fresh generator each time).
            prompt_rng = np.random.default_rng(1)
            prompts = prompt_rng.integers(10, vocab, (PROMPTS, PROMPT_LEN)).tolist()
            cold_prompt, speed_prompt = (prompt_rng.integers(10, vocab, (1, SPEED_PROMPT)).tolist() for _ in range(2))
            # correctness
            start = time.perf_counter()
            logits = first_step_logits(engine, prompts)
            outputs, _ = run_requests(llm, prompts, GREEDY_TOKENS)
            tokens = [list(o.outputs[0].token_ids) for o in outputs]
            entry["correctness_seconds"] = time.perf_counter() - start
            if name == REFERENCE:
                reference.update(logits=logits, tokens=tokens)
                results.record("reference_logits", {"max_abs": float(np.abs(logits).max()),
                                                    "std": float(logits.std()),
                                                    "top2_margin_median": float(np.median(
                                                        np.diff(np.sort(logits, axis=-1)[:, -2:], axis=-1)))})
            elif reference:
                entry["max_abs_logit_diff"] = float(np.abs(logits - reference["logits"]).max())
                entry["mean_abs_logit_diff"] = float(np.abs(logits - reference["logits"]).mean())
                entry["first_argmax_equal"] = int((logits.argmax(-1) == reference["logits"].argmax(-1)).sum())
                entry.update(agreement(reference["tokens"], tokens))
            # speed: batch-1 decode, its second run measured
            start = time.perf_counter()
            run_requests(llm, cold_prompt, new_tokens)
            entry["cold_seconds"] = time.perf_counter() - start
            before = dataclasses.replace(engine.stats)
            compiles.clear()
            counting[0] = True
            outputs, _ = run_requests(llm, speed_prompt, new_tokens)
            counting[0] = False
            m = outputs[0].metrics
            tok_s = (new_tokens - 1) / (m["finished_time"] - m["first_token_time"])
            split = step_split(before, engine.stats)
            total_bytes, embed_bytes = param_bytes(engine)
            kv_token = kv_bytes_per_block(cfg, 1, engine.config.dtype, engine.config.kv_cache_dtype)
            bytes_per_token = step_bytes(engine, SPEED_PROMPT + new_tokens / 2)
            entry.update(weight_bytes=total_bytes, embed_bytes=embed_bytes, kv_bytes_per_token=kv_token,
                         bytes_per_token=bytes_per_token, tok_s=tok_s, ms_per_token=1e3 / tok_s,
                         engine_calls=split["engine_calls"], model_steps=split["model_steps"],
                         host_ms_per_call=split["host_ms_per_call"], compiles_in_measured_run=len(compiles))
            if bandwidth:
                floor_ms = bytes_per_token / (bandwidth * 1e9) * 1e3
                entry.update(roofline_ms=floor_ms, share_of_roofline=floor_ms * tok_s / 1e3)
            entry["status"] = "ok"
        except Exception as e:
            traceback.print_exc()  # into the section's log
            entry.update(status="error", error=f"{type(e).__name__}: {e}"[:2000])
        finally:
            # The next setting loads its own weights: this engine's must leave the device first.
            counting[0] = False
            del llm, engine
            gc.collect()
            jax.clear_caches()
            gc.collect()
            entry["device_bytes_in_use_after_free"] = device_bytes_in_use()
        results.append("rows", entry)


if __name__ == "__main__":
    main()
