"""Run the check's sections one process each, under one overall deadline; merge their results; write the report.

    PYTHONPATH=. python -m benchmarks.gpu_check --out DIR [--device gpu|cpu] [--sections env,kernels,parity,speed,hf]
                                                [--model llama3-8b|qwen3-30b-a3b|deepseek-v2-lite|demo|PATH]
                                                [--deadline 560]
    PYTHONPATH=. python -m benchmarks.gpu_check --out DIR --sections env,profile [--profile-tokens 64] [--keep-trace]
                                                [--profile-command-buffers]
    PYTHONPATH=. python -m benchmarks.gpu_check --out DIR --sections env,quant [--quant-settings bf16,int8,kv_int8,f32]
    PYTHONPATH=. python -m benchmarks.gpu_check --out DIR --sections env,lora
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.gpu_check.common import REPO
from benchmarks.gpu_check.report import markdown

SECTIONS = ("env", "kernels", "parity", "speed", "hf", "warmup", "decode", "gemm", "profile", "quant", "lora")
MODULES = {"env": "env", "kernels": "kernels", "parity": "parity", "speed": "speed", "hf": "hf_peer",
           "warmup": "speed", "decode": "decode", "gemm": "gemm", "profile": "profile",
           "quant": "quant", "lora": "lora"}
# Seconds each section may take at most on a GPU (the deadline may leave less); a CPU run gets 10x.
CAPS = {"env": 30, "kernels": 180, "parity": 300, "speed": 180, "hf": 60, "warmup": 200, "decode": 120,
        "gemm": 150, "profile": 180, "quant": 420, "lora": 240}


def section_env(device: str, section: str) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["JAX_PLATFORMS"] = "cuda" if device == "gpu" else "cpu"
    if section == "parity":  # torch shares the device with jax here
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.5"
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--model", default=None,
                        help="llama3-8b (default on gpu), qwen3-30b-a3b (a mixture of experts), deepseek-v2-lite "
                        "(latent attention and experts; the three shapes with dummy weights), demo (default on cpu) "
                        "or a path")
    parser.add_argument("--sections", default=",".join(SECTIONS[:6]),
                        help=f"of {','.join(SECTIONS)} (the decode, gemm, profile, quant and lora sections only when "
                        "named)")
    parser.add_argument("--deadline", type=float, default=480.0, help="seconds for the whole check")
    parser.add_argument("--concurrency", default=None, help="comma-separated request counts (gpu: 64,256)")
    parser.add_argument("--io", default=None, help="comma-separated input/output lengths (gpu: 128/128,1024/128)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="speed and warmup: the tokens a step may hold (gpu: 2048, cpu: 256)")
    parser.add_argument("--kernel-cases", default=None,
                        help="only these correctness cases, as heads/kv_heads/head_dim/page/dtype (comma-separated)")
    parser.add_argument("--no-kernel-timing", action="store_true", help="kernels: correctness only")
    parser.add_argument("--parity-variants", default=None,
                        help="parity: only these variants of the parity tests (comma-separated; default: all)")
    parser.add_argument("--decode-variants", default=None,
                        help="decode sections: these of decode.VARIANTS (comma-separated)")
    parser.add_argument("--kernel-variants", action="store_true",
                        help="kernels: also time tuning candidates (more splits, 3 stages, 2 warps, 128-key tiles)")
    parser.add_argument("--profile-tokens", type=int, default=64,
                        help="profile: the traced request's new tokens (after a 128-token prompt)")
    parser.add_argument("--keep-trace", action="store_true", help="profile: keep the trace in OUT/profile_trace")
    parser.add_argument("--profile-command-buffers", action="store_true",
                        help="profile: keep CUDA graphs on under the profiler (XLA runs them op by op by default)")
    parser.add_argument("--quant-settings", default=None,
                        help="quant: these of quant.SETTINGS (comma-separated; bf16, the reference, always runs first; "
                             "default bf16,kv_int8,kv_fp8,int8,fp8,int8_cublas; "
                             "f32 adds the float32 yardstick)")
    parser.add_argument("--quantization", default=None, choices=("int8", "fp8"),
                        help="speed, warmup, decode, profile: the engine's weights quantized so (LLM(quantization=))")
    opts = parser.parse_args(argv)
    gpu = opts.device == "gpu"
    args = {"device": opts.device, "model": opts.model or ("llama3-8b" if gpu else "demo"),
            "concurrency": (opts.concurrency or ("64,256" if gpu else "4,8")).split(","),
            "io": (opts.io or ("128/128,1024/128" if gpu else "32/16,128/16")).split(","),
            "ttft_prompt": 2048 if gpu else 256, "decode_tokens": 256 if gpu else 32,
            "hf_batches": [1, 64] if gpu else [1, 4], "hf_io": "128/128" if gpu else "32/16",
            "kv_cache_bytes": (40 << 30) if gpu else (64 << 20),
            "max_num_batched_tokens": opts.max_num_batched_tokens or (2048 if gpu else 256),
            "kernel_cases": opts.kernel_cases.split(",") if opts.kernel_cases else None,
            "kernel_timing": not opts.no_kernel_timing, "kernel_variants": opts.kernel_variants,
            "decode_variants": opts.decode_variants.split(",") if opts.decode_variants else None,
            "variants": opts.parity_variants.split(",") if opts.parity_variants else None,
            "profile_tokens": opts.profile_tokens, "keep_trace": opts.keep_trace,
            "profile_command_buffers": opts.profile_command_buffers,
            "quant_settings": opts.quant_settings.split(",") if opts.quant_settings else None,
            "quantization": opts.quantization}
    opts.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    merged: dict = {"args": args, "sections": {}}
    for section in [s for s in opts.sections.split(",") if s]:
        if section not in SECTIONS:
            parser.error(f"unknown section {section!r}; expected some of {SECTIONS}")
        left = opts.deadline - (time.monotonic() - start)
        limit = min(CAPS[section] * (1 if gpu else 10), left - 5)
        if limit < 10:
            merged["sections"][section] = {"status": "skipped: deadline"}
            continue
        env_results = merged["sections"].get("env", {})
        # The roofline's bandwidth: the larger of the copy and read rates the device reached.
        rates = [env_results.get(k, {}).get("gb_per_s") for k in ("hbm_bandwidth", "hbm_read_bandwidth")]
        args["hbm_gb_per_s"] = max(filter(None, rates), default=None)
        args["matmul_tflops"] = env_results.get("bf16_matmul", {}).get("tflops")
        out_json = opts.out / f"{section}.json"
        out_json.unlink(missing_ok=True)
        log = opts.out / f"{section}.log"
        began = time.monotonic()
        section_args = dict(args, full_warmup=section == "warmup")
        cmd = [sys.executable, "-m", f"benchmarks.gpu_check.{MODULES[section]}", json.dumps(section_args),
               str(out_json)]
        with open(log, "w") as log_file:
            try:
                proc = subprocess.run(cmd, stdout=log_file, stderr=subprocess.STDOUT, timeout=limit,
                                      env=section_env(opts.device, section), cwd=REPO)
                status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
            except subprocess.TimeoutExpired:
                status = f"timed out after {limit:.0f} s"
        data = json.loads(out_json.read_text()) if out_json.exists() else {}
        data["status"] = status
        data["seconds"] = round(time.monotonic() - began, 1)
        if status != "ok":
            data["log_tail"] = log.read_text(errors="replace")[-3000:]
        merged["sections"][section] = data
        print(f"== {section}: {status} in {data['seconds']} s", flush=True)
        (opts.out / "gpu_check.json").write_text(json.dumps(merged, indent=1, default=str))
    merged["total_seconds"] = round(time.monotonic() - start, 1)
    (opts.out / "gpu_check.json").write_text(json.dumps(merged, indent=1, default=str))
    report = markdown(merged)
    (opts.out / "gpu_check.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
