"""The CPU parameters' host memory: copied exactly, not copied again by JAX, and marked for huge pages."""

from __future__ import annotations

import gc
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from checkpoints.host_arena import HugePageArena

pytestmark = pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
                                reason="no transparent huge pages (Linux only) on this host")


def _vm_flags(address: int) -> list[str]:
    """The kernel's flags for the mapping holding `address` (/proc/self/smaps): 'hg' is MADV_HUGEPAGE."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_arena_arrays_are_exact_copies_in_huge_page_memory():
    arena = HugePageArena(chunk_bytes=8 << 20)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((300, 577)).astype(np.float32),  # odd sizes: each starts on its own page
              rng.integers(0, 1 << 31, (96, 288, 32), dtype=np.int64).astype(np.uint32),
              rng.standard_normal((2000, 1100)).astype(np.float32),  # 8.8 MB: more than a chunk, a mapping of its own
              rng.standard_normal((512, 576)).astype(ml_dtypes.bfloat16)]
    placed = [arena.place(a) for a in arrays]
    del arena
    gc.collect()  # the mappings live as long as the arrays in them
    for source, array in zip(arrays, placed, strict=True):
        assert array.dtype == source.dtype and array.shape == source.shape
        np.testing.assert_array_equal(np.asarray(array), source)
        np.testing.assert_array_equal(np.asarray(array[::7] + 1), source[::7] + 1)  # a jitted op reads it
        assert array.unsafe_buffer_pointer() % 4096 == 0
        assert "hg" in _vm_flags(array.unsafe_buffer_pointer())


def test_small_arrays_go_through_device_put():
    arena = HugePageArena()
    small = arena.place(np.ones(16, np.float32))
    np.testing.assert_array_equal(np.asarray(small), np.ones(16, np.float32))
    assert "hg" not in _vm_flags(small.unsafe_buffer_pointer())


def test_cpu_models_load_into_the_arena(hf_model_dir):
    import jax

    from checkpoints.loading import load_model

    for dtype in ("float32", "bfloat16"):
        model = load_model(hf_model_dir("llama"), dtype, "cpu")
        large = [leaf for leaf in jax.tree.leaves(model.state) if leaf.nbytes >= 64 << 10]
        assert large and all("hg" in _vm_flags(leaf.unsafe_buffer_pointer()) for leaf in large)
        assert any(leaf.dtype == jnp.dtype(dtype) for leaf in large)
