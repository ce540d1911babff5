"""Lower every kernel for a platform we may not have, at the shapes the engine uses: `python -m
tools.check_lowering --platform tpu|cuda`. Exits non-zero if any lowering fails, or leaves a while loop beside the
kernel.

`jax.export` runs the Pallas -> Mosaic (tpu) or Pallas -> Triton (cuda) lowering on any host, so a kernel that
uses an op, layout or indexing the target's lowering rejects fails here without the hardware. What it cannot
check is the target's own compiler pass that runs at load time on the device (Mosaic's layout passes in
libtpu, Triton's PTX generation in XLA:GPU); docs/kernels.md says so.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import export

from pallas_kernels.interface import ragged_paged_attention

# The engine's entry point with backend="pallas" picks the kernel by the platform being lowered for (Mosaic for
# tpu, Triton for cuda); the custom call in the exported module shows which one was lowered.
CUSTOM_CALL = {"tpu": "tpu_custom_call", "cuda": "__gpu$xla.gpu.triton"}


@dataclass(frozen=True)
class Shape:
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    num_pages: int
    max_pages_per_seq: int  # max_model_len / page_size: the widest page-table bucket


# Llama-3-8B (bf16, 32 q heads over 8 KV heads, head_dim 128, 8k context) and the benchmark's 135M-shaped model
# (9 heads over 3 KV heads, head_dim 64) in both dtypes it is measured in; then head dims that are not powers of two,
# which the Triton kernel runs as power-of-two chunks, lowered at the buckets only (VARIANTS change no chunking):
# Phi-3-mini (32 heads over 32 KV heads, head_dim 96 = 64 + 32: one key split) and DeepSeek-V2-Lite's latent
# attention (16 heads over one KV head of 576 = 512 + 64: several key splits, merged after the kernel).
SHAPES = [
    Shape("llama3-8b", 32, 8, 128, "bfloat16", 16, 4096, 8192 // 16),
    Shape("bench-135m", 9, 3, 64, "bfloat16", 16, 2048, 2048 // 16),
    Shape("bench-135m", 9, 3, 64, "float32", 16, 2048, 2048 // 16),
]
CHUNKED_HEAD_DIM_SHAPES = [
    Shape("phi3-mini", 32, 32, 96, "bfloat16", 16, 4096, 4096 // 16),
    Shape("deepseek-v2-lite", 16, 1, 576, "bfloat16", 16, 4096, 8192 // 16),
]
# (tokens T, sequence rows S, page-table width P) buckets as the runner pads them: the smallest decode bucket, a
# mid-size mixed one and the largest (max_num_batched_tokens 512, max_num_seqs 32, widest page table).
BUCKETS = [(8, 8, 1), (64, 32, 16), (512, 32, None)]
# Optional features change the kernel body; lower them once per shape at the mid bucket. "sinks": gpt-oss's attention
# sinks, a float32 [H] argument (at the mid bucket the Triton kernel normalizes in the kernel for llama3-8b and
# merges key splits for bench-135m, so both places the sinks join are lowered).
VARIANTS = [{}, {"sliding_window": 4096, "soft_cap": 50.0}, {"sliding_window": 128, "sinks": True},
            {"attention_chunk": 8192}]  # Llama 4's chunked attention


def lower(platform: str, shape: Shape, tokens: int, seqs: int, pages: int, *, sinks: bool = False,
          **features) -> str:
    """Export one kernel call for `platform`; returns the StableHLO text (raises on a lowering failure)."""
    dtype = jnp.dtype(shape.dtype)
    cache = jax.ShapeDtypeStruct((shape.num_pages, shape.page_size, shape.kv_heads, shape.head_dim), dtype)
    args = (jax.ShapeDtypeStruct((tokens, shape.heads, shape.head_dim), dtype), cache, cache,
            jax.ShapeDtypeStruct((seqs, pages), jnp.int32), jax.ShapeDtypeStruct((seqs + 1,), jnp.int32),
            jax.ShapeDtypeStruct((seqs,), jnp.int32))
    attention = functools.partial(ragged_paged_attention, scale=shape.head_dim**-0.5, backend="pallas", **features)
    if sinks:  # an argument, as the model's weights give them, not a constant folded into the module
        args = (*args, jax.ShapeDtypeStruct((shape.heads,), jnp.float32))
        fn = jax.jit(lambda *a: attention(*a[:6], sinks=a[6]))
    else:
        fn = jax.jit(attention)
    # The Triton call is not on export's list of stable custom calls (its IR is tied to the jaxlib version).
    disabled = [export.DisabledSafetyCheck.custom_call(CUSTOM_CALL["cuda"])] if platform == "cuda" else []
    return export.export(fn, platforms=[platform], disabled_checks=disabled)(*args).mlir_module()


def cases():
    for shape in SHAPES + CHUNKED_HEAD_DIM_SHAPES:
        for tokens, seqs, pages in BUCKETS:
            pages = pages or shape.max_pages_per_seq
            with_features = (tokens, seqs) == (64, 32) and shape in SHAPES
            for features in VARIANTS if with_features else VARIANTS[:1]:
                yield shape, tokens, seqs, pages, features


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--platform", choices=sorted(CUSTOM_CALL), required=True)
    args = parser.parse_args(argv)
    failures = 0
    for shape, tokens, seqs, pages, features in cases():
        label = f"{args.platform} {shape.name} {shape.dtype} T={tokens} S={seqs} P={pages} {features or ''}"
        start = time.perf_counter()
        try:
            text = lower(args.platform, shape, tokens, seqs, pages, **features)
            if CUSTOM_CALL[args.platform] not in text:
                raise RuntimeError(f"no {CUSTOM_CALL[args.platform]} custom call in the exported module")
            # The kernel's own loops are inside its custom call; a while loop beside it (the block metadata's
            # search) would run level by level on the device, its condition tested at each.
            if "stablehlo.while" in text:
                raise RuntimeError("a while loop outside the kernel in the exported module")
        except Exception as e:  # report every case, then fail
            failures += 1
            print(f"FAIL {label}: {type(e).__name__}: {e}", flush=True)
            continue
        print(f"ok   {label} ({time.perf_counter() - start:.1f}s)", flush=True)
    print(f"{args.platform}: {failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
