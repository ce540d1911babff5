"""What a jitted call's dispatch costs per array argument, with the caches warm and after a 300 MB read (what a decode
step's weight stream leaves behind).

    python benchmarks/dispatch_micro.py

The engine's step took the 135M model's 182 parameters and 60 donated K/V arrays, until the CPU backend stacked the
K/V cache (2 arrays) and then the layers' weights (8 parameter arrays in all); the calls here take as many tiny
arrays and do no work, so the figure is the host's per-argument cost alone: the engine thread's CPU time of the
call, median of 100.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

SHAPES = [(182, 60), (182, 2), (8, 2)]  # (parameters, donated cache arrays)


def compiled_call(num_params: int, num_cache: int):
    params = [jnp.ones((4, 4), jnp.float32) for _ in range(num_params)]
    cache = [jnp.zeros((8, 4), jnp.float32) for _ in range(num_cache)]

    def step(params, cache, packed):
        cache = [c.at[0, 0].set(packed[0].astype(jnp.float32)) for c in cache]
        return cache, sum(p[0, 0] for p in params) + packed[1]

    packed = np.zeros(64, np.int32)
    return jax.jit(step, donate_argnums=(1,)).lower(params, cache, packed).compile(), params, cache, packed


def main() -> None:
    flush = np.ones((300 << 20) // 4, np.float32)
    for cold in (False, True):
        for num_params, num_cache in SHAPES:
            call, params, cache, packed = compiled_call(num_params, num_cache)
            seconds = []
            for _ in range(120):
                if cold:
                    flush.sum()
                start = time.thread_time()
                cache, out = call(params, cache, packed)
                seconds.append(time.thread_time() - start)
                out.block_until_ready()
            print(f"{'after a 300 MB read' if cold else 'caches warm':20s} {num_params:3d} parameters + {num_cache:2d} "
                  f"donated arrays: {statistics.median(seconds[20:]) * 1e6:6.1f} us a call")


if __name__ == "__main__":
    main()
