"""Section env: the device, driver and library versions, and the ceilings measured here (HBM copy and read
bandwidth, bf16 matmul rate) that the speed sections are held against."""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess

from benchmarks.gpu_check.common import section_args, time_calls


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "torch", "transformers",
                 "triton", "numpy"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _nvidia_smi() -> dict:
    try:
        line = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    fields = [f.strip() for f in line.splitlines()[0].split(",")] if line.strip() else []
    return dict(zip(("gpu", "driver", "memory_total", "max_sm_clock"), fields, strict=False))


def main() -> None:
    args, results = section_args()
    results.record("versions", _versions())
    results.record("nvidia_smi", _nvidia_smi())
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    results.record("device", {"platform": device.platform, "kind": device.device_kind,
                              "count": jax.device_count(), "memory": (device.memory_stats() or {}).get("bytes_limit")})
    on_gpu = device.platform == "gpu"
    # Bandwidth: an elementwise pass over 4 GiB (1/64 of that on a CPU) reads and writes each byte once.
    n = (1 << 30) if on_gpu else (1 << 24)
    x = jnp.ones((n,), jnp.float32)
    scale = jax.jit(lambda a: a * 1.000001)
    seconds = time_calls(lambda: scale(x).block_until_ready(), repeats=20, warmup=3)
    results.record("hbm_bandwidth", {"bytes": 2 * 4 * n, "seconds": seconds, "gb_per_s": 2 * 4 * n / seconds / 1e9})
    # Read bandwidth, what a decode step spends its time on: a jitted loop of 8 reductions over the same 4 GiB
    # (perturbed per pass, so nothing is hoisted), no writes. The roofline uses the larger of the two rates.
    def read_passes(a):
        def body(i, acc):
            return acc + jnp.sum(a * (1 + i.astype(jnp.float32) * 1e-7))

        return jax.lax.fori_loop(0, 8, body, jnp.float32(0))

    reads = jax.jit(read_passes)
    seconds = time_calls(lambda: reads(x).block_until_ready(), repeats=5, warmup=2) / 8
    results.record("hbm_read_bandwidth", {"bytes": 4 * n, "seconds": seconds, "gb_per_s": 4 * n / seconds / 1e9})
    x = None  # the 4 GiB buffer is not needed by the matmul
    # Matmul rate: bf16 [m, k] x [k, n] with float32 accumulation, on random data.
    size = 8192 if on_gpu else 1024
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.random.normal(key_a, (size, size), jnp.bfloat16)
    b = jax.random.normal(key_b, (size, size), jnp.bfloat16)
    dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    seconds = time_calls(lambda: dot(a, b).block_until_ready(), repeats=10, warmup=3)
    results.record("bf16_matmul", {"size": size, "seconds": seconds, "tflops": 2 * size**3 / seconds / 1e12})


if __name__ == "__main__":
    main()
