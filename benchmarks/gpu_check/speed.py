"""Section speed: the engine on a real-sized model (Llama-3-8B's shape, dummy bf16 weights drawn on the device):
load time, batch-1 decode against the HBM roofline, TTFT of a long prompt, offline throughput at several
concurrencies and lengths, each measured on its second run (the first compiles what it needs; the second must
compile nothing). With args["full_warmup"] (the warmup section) it instead times the engine's own warm-up, which
compiles every step shape up front as `jserve serve` does.

Roofline of a decode token at batch 1: the bytes it must read (jserve.bench.roofline: every weight but the embedding
table, of which it reads one row, and of a mixture of experts only the experts it chose; plus its K/V) over the
bandwidth env measured. Throughput's roofline per output token is the larger of the step's bytes (of a mixture of
experts, the experts its tokens are expected to reach) over the bandwidth and its FLOPs over the matmul rate env
measured.
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

from benchmarks.gpu_check.common import model_dir, section_args, work_dir


def param_bytes(engine) -> tuple[int, int]:
    """(bytes of every parameter, bytes of the embedding table)."""
    import jax

    total = sum(leaf.nbytes for leaf in jax.tree.leaves(engine.executor.params))
    cfg = engine.model_config
    embed = cfg.vocab_size * cfg.hidden_size * (2 if engine.config.dtype == "bfloat16" else 4)
    return total, embed


def step_bytes(engine, context: float, sequences: int = 1) -> float:
    """Bytes a decode step of `sequences` sequences, each attending over `context` tokens, reads: the weights it
    reaches and the K/V (jserve.bench.roofline, as `jserve bench latency` counts them)."""
    from jserve.bench.roofline import kv_bytes_per_token as kv_read
    from jserve.bench.roofline import weight_bytes_read_per_token

    cfg, config = engine.model_config, engine.config
    return (weight_bytes_read_per_token(cfg, config.dtype, config.quantization, sequences)
            + sequences * kv_read(cfg, config.dtype, context, config.kv_cache_dtype))


def kv_bytes_per_token(engine) -> int:
    cfg = engine.model_config
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (2 if engine.config.dtype == "bfloat16" else 4)


def run_requests(llm, prompts: list[list[int]], max_tokens: int, lora_request=None):
    """Greedy requests of max_tokens each (lora_request: as LLM.generate's, one for all or one a prompt)."""
    from jserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                           lora_request=lora_request)
    return outputs, time.perf_counter() - start


def main() -> None:
    import jax
    from jax._src import dispatch

    from jserve import LLM
    from jserve.bench.roofline import weight_params_read_per_token

    args, results = section_args()
    on_gpu = jax.default_backend() == "gpu"
    path, load_format = model_dir(args["model"], work_dir())
    settings = engine_settings(args, load_format, on_gpu)
    results.record("settings", {**settings, "model": args["model"], "model_dir": str(path),
                                "xla_flags": os.environ.get("XLA_FLAGS", "")})
    start = time.perf_counter()
    llm = LLM(str(path), warmup=False, **settings)
    engine = llm.engine
    jax.block_until_ready(engine.executor.params)
    results.record("load_seconds", time.perf_counter() - start)
    if args.get("full_warmup"):  # the warmup section: every step shape compiled up front, as `jserve serve` does
        start = time.perf_counter()
        engine.warmup()
        runner = engine.executor
        results.record("warmup", {"seconds": time.perf_counter() - start, "step_shapes": len(runner._compiled),
                                  "burst_shapes": len(runner._compiled_bursts),
                                  "token_buckets": runner.token_buckets, "page_buckets": runner.page_buckets})
        return
    total_bytes, embed_bytes = param_bytes(engine)
    cfg = engine.model_config
    kv_token = kv_bytes_per_token(engine)
    results.record("model", {"params_bytes": total_bytes, "embed_bytes": embed_bytes, "layers": cfg.num_layers,
                             "hidden": cfg.hidden_size, "vocab": cfg.vocab_size, "kv_bytes_per_token": kv_token})
    # Each workload runs twice: the first compiles the shapes it needs (timed as "cold"), the second is measured,
    # and must compile nothing.
    compiles: list[str] = []
    counting = [False]
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.append(event)
        if counting[0] and event == dispatch.BACKEND_COMPILE_EVENT else None)
    jax.config.update("jax_log_compiles", True)  # names, in the section's log, whatever compiles
    rng = np.random.default_rng(0)
    vocab = min(cfg.vocab_size, 32000)

    def measured(n: int, in_len: int, out_len: int):
        counting[0] = False
        _, cold = run_requests(llm, rng.integers(10, vocab, (n, in_len)).tolist(), out_len)
        counting[0] = True
        before = dataclasses.replace(engine.stats)
        outputs, seconds = run_requests(llm, rng.integers(10, vocab, (n, in_len)).tolist(), out_len)
        counting[0] = False
        last_steps[0] = step_split(before, engine.stats)
        return outputs, seconds, cold

    last_steps = [{}]

    bandwidth, flops_rate = args.get("hbm_gb_per_s"), args.get("matmul_tflops")
    # Batch-1 decode: one request, its decode rate from the engine's own first-token and finish times.
    decode_len = int(args.get("decode_tokens", 256))
    outputs, _, cold = measured(1, 128, decode_len)
    m = outputs[0].metrics
    tok_s = (decode_len - 1) / (m["finished_time"] - m["first_token_time"])
    bytes_per_token = step_bytes(engine, 128 + decode_len / 2)
    entry = {"prompt": 128, "new_tokens": decode_len, "tok_s": tok_s, "ms_per_token": 1e3 / tok_s,
             "bytes_per_token": bytes_per_token, "cold_seconds": cold, **last_steps[0]}
    if bandwidth:
        floor = bytes_per_token / (bandwidth * 1e9)
        entry.update(roofline_ms=floor * 1e3, share_of_roofline=floor * tok_s)
    results.record("batch1_decode", entry)
    # TTFT of one long prompt, alone on the engine (one token out: its time is the prefill's).
    ttft_prompt = int(args["ttft_prompt"])
    _, seconds, cold = measured(1, ttft_prompt, 1)
    results.record("ttft", {"prompt": ttft_prompt, "seconds": seconds, "prefill_tok_s": ttft_prompt / seconds,
                            "cold_seconds": cold, **last_steps[0]})
    # Offline throughput: n requests at once of in/out tokens each.
    flops_token = 2 * weight_params_read_per_token(cfg)  # a multiply and an add per weight the token reaches
    for n in (int(c) for c in args["concurrency"]):
        for in_len, out_len in (tuple(map(int, s.split("/"))) for s in args["io"]):
            try:
                outputs, seconds, cold = measured(n, in_len, out_len)
                generated = sum(len(o.outputs[0].token_ids) for o in outputs)
                entry = {"concurrent": n, "input": in_len, "output": out_len, "seconds": seconds,
                         "output_tok_s": generated / seconds, "total_tok_s": (generated + n * in_len) / seconds,
                         "cold_seconds": cold, **last_steps[0]}
                if bandwidth and flops_rate:
                    # Floor: the prompts' FLOPs at the matmul rate, then each decode step's larger of its weights +
                    # K/V bytes over the bandwidth and its FLOPs over the matmul rate.
                    floor = n * in_len * flops_token / (flops_rate * 1e12)
                    for step in range(out_len - 1):
                        read = step_bytes(engine, in_len + step, n)
                        floor += max(read / (bandwidth * 1e9), n * flops_token / (flops_rate * 1e12))
                    entry.update(roofline_seconds=floor, share_of_roofline=floor / seconds)
                results.append("throughput", entry)
            except Exception as e:
                results.append("throughput", {"concurrent": n, "input": in_len, "output": out_len,
                                              "error": f"{type(e).__name__}: {e}"[:2000]})
    results.record("compiles_in_measured_runs", len(compiles))
    stats = engine.stats
    results.record("engine_stats", {"steps": stats.num_steps, "engine_steps": stats.num_engine_steps,
                                    "step_seconds": stats.step_seconds,
                                    "device_wait_seconds": stats.device_wait_seconds})


def step_split(before, after) -> dict:
    """The engine calls and model steps of a run, and each call's time split into the host's work and the wait for
    the device (EngineStats): a decode burst is one call of several steps."""
    calls = after.num_engine_steps - before.num_engine_steps
    wall = after.step_seconds - before.step_seconds
    wait = after.device_wait_seconds - before.device_wait_seconds
    return {"engine_calls": calls, "model_steps": after.num_steps - before.num_steps,
            "host_ms_per_call": 1e3 * (wall - wait) / max(calls, 1),
            "device_wait_ms_per_call": 1e3 * wait / max(calls, 1)}


def engine_settings(args: dict, load_format: str, on_gpu: bool) -> dict:
    io_shapes = [tuple(map(int, s.split("/"))) for s in args["io"]]
    max_in = max([i for i, _ in io_shapes] + [int(args["ttft_prompt"])])
    max_out = max(o for _, o in io_shapes)
    return dict(dtype=args.get("dtype", "bfloat16"), load_format=load_format,
                attention_backend="pallas" if on_gpu else args.get("cpu_backend", "auto"),
                max_model_len=-(-(max_in + max_out + 256) // 16) * 16,
                max_num_seqs=max(int(c) for c in args["concurrency"]),
                max_num_batched_tokens=int(args.get("max_num_batched_tokens", 2048)),
                kv_cache_memory_bytes=int(args.get("kv_cache_bytes", 0)) or None, compilation_cache_dir="",
                quantization=args.get("quantization"))


if __name__ == "__main__":
    main()
