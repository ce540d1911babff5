"""Random weights of a checkpoint's shape, from its config.json alone (vLLM's `load_format="dummy"`).

For benchmarks and checks of real-sized shapes without downloading weights. Each parameter is drawn by a jitted
function whose output sharding is the parameter's own, so on a GPU or TPU (or a mesh) the values are made where
they live and never cross the host. Matrices are normal(0, 0.02) (transformers' initializer_range), norm weights
ones and biases zeros, so activations stay in range through any number of layers; the draw is deterministic
(seed and parameter order).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding

DUMMY_STD = 0.02


class DummySource:
    """A ParamSource look-alike (shape, dtype, read(index)) over a drawn array, for loaders that place host
    blocks themselves (the CPU layer kernel packs its weights from host arrays)."""

    def __init__(self, array: jax.Array):
        self.array = array
        self.shape, self.dtype = tuple(array.shape), np.dtype(array.dtype)

    def read(self, index: tuple = ()) -> np.ndarray:
        return np.asarray(self.array[tuple(index)])


@functools.cache
def _drawer(shape: tuple[int, ...], dtype: np.dtype, kind: str, sharding: Sharding | None) -> Callable:
    """The jitted draw of one parameter kind, shape and placement: a model has a handful (an 8B Llama 7 shapes),
    so a 32-layer model compiles each once, not once per layer."""

    def make(key: jax.Array) -> jax.Array:
        if kind == "ones":
            return jnp.ones(shape, dtype)
        if kind == "zeros":
            return jnp.zeros(shape, dtype)
        return (DUMMY_STD * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    return jax.jit(make) if sharding is None else jax.jit(make, out_shardings=sharding)


def _kind(path: tuple) -> str:
    if path[-1] == "bias":
        return "zeros"
    if len(path) >= 2 and str(path[-2]).endswith("norm"):
        return "ones"
    return "normal"


def draw(shapes: dict[tuple, tuple[tuple[int, ...], np.dtype]], sharding_of: Callable[[tuple], Sharding | None],
         seed: int = 0) -> Iterator[tuple[tuple, jax.Array]]:
    """(path, random array) for each parameter ({path: (shape, dtype)}), one at a time, placed by sharding_of(path)
    (None: the default device)."""
    root = jax.random.key(seed)
    for i, (path, (shape, dtype)) in enumerate(shapes.items()):
        yield path, _drawer(tuple(shape), np.dtype(dtype), _kind(path), sharding_of(path))(jax.random.fold_in(root, i))
