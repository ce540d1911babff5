"""cpu_kernels against XLA at the 135M benchmark model's shapes, side by side in one process.

    python benchmarks/cpu_kernels_micro.py            # ms per call: XLA / kernel, per weight, dtype and row count

Matmuls: each of the model's weights ([out, in]) times x[M, in] for decode (M = 1..32) and prefill (M = 64..512)
row counts, XLA's dot_general (bf16 x with an f32 result, as the reference path runs it) against
cpu_kernels.matmul, and on a CPU that packs weights (cpu_kernels.packs_weights) the same kernel on the weight
packed once (cpu_kernels.pack_weight, as the loader does). Attention: one layer of 32 decodes over 200
cached tokens, the gathering reference against the kernel, with a bf16 (uint16 bits) cache. Each figure is the
mean of 30 calls after one untimed call.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import cpu_kernels
from pallas_kernels import ragged_paged_attention

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
ROWS = (1, 4, 8, 16, 32, 64, 128, 256, 512)


def mean_ms(fn, *args, calls: int = 30) -> float:
    fn(*args).block_until_ready()
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    out.block_until_ready()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    if not cpu_kernels.available():
        raise SystemExit(f"cpu_kernels unavailable: {cpu_kernels.unavailable_reason()}")
    rng = np.random.default_rng(0)
    xla = jax.jit(lambda x, w: jax.lax.dot_general(x.astype(w.dtype), w, (((1,), (1,)), ((), ())),
                                                   preferred_element_type=jnp.float32))
    kernel = jax.jit(cpu_kernels.matmul, static_argnums=2)
    print("matmul, ms per call as XLA / kernel (/ kernel on the weight packed, where this CPU packs that dtype)")
    for dtype in ("float32", "bfloat16"):
        for name, (out_features, in_features) in SHAPES.items():
            w = jnp.asarray(rng.standard_normal((out_features, in_features), np.float32)).astype(dtype)
            packed = jnp.asarray(cpu_kernels.pack_weight(np.asarray(w))) if cpu_kernels.packs_weights(dtype) else None
            cells = []
            for rows in ROWS:
                x = jnp.asarray(rng.standard_normal((rows, in_features), np.float32))
                calls = 5 if name == "lm_head" else 30
                times = [mean_ms(xla, x, w, calls=calls), mean_ms(kernel, x, w, None, calls=calls)]
                if packed is not None:
                    times.append(mean_ms(kernel, x, packed, out_features, calls=calls))
                cells.append(f"M={rows}: " + "/".join(f"{t:.3f}" for t in times))
            print(f"{dtype:9s} {name:8s}", " | ".join(cells), flush=True)

    seqs, context, heads, kv_heads, head_dim, page_size = 32, 200, 9, 3, 64, 16
    pages = -(-context // page_size)
    cache = (seqs * pages, page_size, kv_heads, head_dim)
    as_bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.uint16)
    k_pages = as_bits(jnp.asarray(rng.standard_normal(cache), jnp.bfloat16))
    v_pages = as_bits(jnp.asarray(rng.standard_normal(cache), jnp.bfloat16))
    q = jnp.asarray(rng.standard_normal((seqs, heads, head_dim)), jnp.float32)
    page_table = jnp.asarray(rng.permutation(seqs * pages).reshape(seqs, pages), jnp.int32)
    query_start = jnp.arange(seqs + 1, dtype=jnp.int32)
    seq_lens = jnp.full(seqs, context, jnp.int32)
    print(f"attention, {seqs} decodes of {context} tokens, bf16 cache, one layer (ms per call)")
    for backend in ("reference", "cpu"):
        fn = jax.jit(functools.partial(ragged_paged_attention, scale=head_dim**-0.5, backend=backend))
        print(f"  {backend:9s} {mean_ms(fn, q, k_pages, v_pages, page_table, query_start, seq_lens):.3f}")


if __name__ == "__main__":
    main()
