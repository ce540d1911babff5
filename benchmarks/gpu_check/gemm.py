"""Section gemm: each weight matrix of a Llama-3-8B layer and its LM head, multiplied as a decode step multiplies
them (layers.matmul: x[rows, in] @ w[out, in]^T, float32 out, bfloat16 weights), by XLA under several compiler
settings (per executable, as the engine sets its own: jserve.executors.xla.step_compiler_options).

Each timing is a jitted loop whose body multiplies x by enough distinct copies of the weight to exceed the L2
cache (as the model's 16 GB of weights do), so the figure is the rate the weights stream from HBM. The sum over
one layer's matrices times the layer count plus the LM head is the GEMM floor of one decode step.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gpu_check.common import LLAMA3_8B, section_args

# XLA's settings: cuBLAS by its heuristics (what the engine's steps compile with on a GPU), cuBLAS with its
# algorithms timed per shape, and XLA's default (its Triton GEMM, autotuned). The loop's own kernels (the
# perturbation, the sums) add the same time to every variant: compare variants, not absolute rates.
XLA_VARIANTS = {
    "xla_cublas": {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0},
    "xla_cublas_autotuned": {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 4},
    "xla_triton_autotuned": {},
}
L2_BYTES = 256 << 20  # copies of a weight per loop step until this many bytes: far past an H200's 50 MB L2


def weight_shapes(config: dict) -> dict[str, tuple[int, int]]:
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads
    return {"qkv_proj": ((heads + 2 * kv_heads) * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
            "gate_up_proj": (2 * config["intermediate_size"], hidden),
            "down_proj": (hidden, config["intermediate_size"]),
            "lm_head": (config["vocab_size"], hidden)}


def time_product(x: jax.Array, weights: list[jax.Array], compiler_options: dict | None,
                 streamed_bytes: float) -> float:
    """Seconds per weight of the model's x @ w^T (layers.matmul), from a jitted loop over every copy in weights
    reading about streamed_bytes in all."""
    from jserve.models.layers import matmul

    reps = max(4, int(streamed_bytes / sum(w.nbytes for w in weights)))

    def loop(x, *ws):
        def body(i, acc):
            xi = x * (1 + i.astype(x.dtype) * 1e-3)  # nothing hoisted out of the loop
            return acc + sum(matmul(xi, w).sum() for w in ws)

        return jax.lax.fori_loop(0, reps, body, jnp.float32(0))

    fn = jax.jit(loop, compiler_options=compiler_options or None)
    fn(x, *weights).block_until_ready()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        fn(x, *weights).block_until_ready()
        best = min(best, (time.perf_counter() - start) / (reps * len(weights)))
    return best


def main() -> None:
    args, results = section_args()
    on_gpu = jax.default_backend() == "gpu"
    bandwidth = args.get("hbm_gb_per_s")
    rows = 8  # the engine's smallest token bucket: a lone decode is padded to it
    config = LLAMA3_8B if on_gpu else {**LLAMA3_8B, "hidden_size": 512, "intermediate_size": 1024,
                                       "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 2048}
    shapes = weight_shapes(config)
    variants = XLA_VARIANTS if on_gpu else {"xla_cublas": XLA_VARIANTS["xla_cublas"]}
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((rows, config["hidden_size"])), jnp.bfloat16)
    totals: dict[str, float] = {}
    for matrix, (n, k) in shapes.items():
        w = jnp.asarray(rng.standard_normal((n, k)) * 0.02, jnp.bfloat16)
        copies = max(1, -(-L2_BYTES // w.nbytes)) if on_gpu else 1
        weights = [w + jnp.bfloat16(i * 1e-3) for i in range(copies)]
        xk = x if k == x.shape[1] else jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
        count = 1 if matrix == "lm_head" else config["num_hidden_layers"]
        for name, options in variants.items():
            entry = {"matrix": matrix, "shape": [n, k], "rows": rows, "variant": name}
            try:
                seconds = time_product(xk, weights, options, 4e9 if on_gpu else 0)
            except Exception as e:  # a setting the compiler refuses is a result too
                entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                results.append("matmuls", entry)
                continue
            entry.update(us=seconds * 1e6, gb_per_s=w.nbytes / seconds / 1e9)
            if bandwidth:
                entry["share_of_hbm"] = entry["gb_per_s"] / bandwidth
            totals[name] = totals.get(name, 0.0) + seconds * count
            results.append("matmuls", entry)
    weight_bytes = sum(n * k * 2 * (1 if m == "lm_head" else config["num_hidden_layers"])
                       for m, (n, k) in shapes.items())
    summary = {}
    for name, seconds in totals.items():
        summary[name] = {"step_ms": seconds * 1e3, "gb_per_s": weight_bytes / seconds / 1e9}
        if bandwidth:
            summary[name]["share_of_hbm"] = summary[name]["gb_per_s"] / bandwidth
    results.record("decode_step_gemms", summary)


if __name__ == "__main__":
    main()
