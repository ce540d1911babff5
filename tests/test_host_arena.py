"""The CPU parameters' host memory: copied exactly, not copied again by JAX, and marked for huge pages."""

from __future__ import annotations

import gc
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import cpu_kernels
from jserve.executors.host_arena import HugePageArena, LayerStacks

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
    # Nothing was mapped for it. (Its page's flags say nothing: XLA's own allocator may sit on huge pages.)
    assert arena._chunk is None


def test_cpu_models_load_into_the_arena(hf_model_dir):
    import jax

    from jserve.executors import CpuLayerExecutor

    for dtype in ("float32", "bfloat16"):
        model = CpuLayerExecutor.load(hf_model_dir("llama"), dtype=dtype)
        large = [leaf for leaf in jax.tree.leaves(model.state) if leaf.nbytes >= 64 << 10]
        assert large and all("hg" in _vm_flags(leaf.unsafe_buffer_pointer()) for leaf in large)
        assert any(leaf.dtype == jnp.dtype(dtype) for leaf in large)
        # The layer kernel's stacks are the layers' own memory: layer i's array is slice i of its kind's stack.
        stack, layers = model.layer_stack, model.state["layers"]
        if dtype == "bfloat16" and not cpu_kernels.packs_weights(dtype):
            assert stack is None  # unpacked bfloat16 (AMX: XLA's dot takes plain weights) has no zero-copy view
            continue
        assert stack is not None and stack.input_norm.shape[0] == len(layers)
        for i, layer in layers.items():
            norm = layer["input_layernorm"]["weight"][...]
            assert norm.unsafe_buffer_pointer() == stack.input_norm.unsafe_buffer_pointer() + i * norm.nbytes
        # The matrices are held once, in per-thread parts: the layers' own are empty placeholders.
        if stack.matrix_parts is not None:
            assert "hg" in _vm_flags(stack.matrix_parts.unsafe_buffer_pointer())
            assert stack.matrix_parts.shape[:2] == (cpu_kernels.kernel_threads(), len(layers))
            assert all(layer["mlp"]["down_proj"]["weight"][...].size == 0 for layer in layers.values())
        # Without parts, the matrices are stacked like the rest, each layer's a view of its slice.
        flat = CpuLayerExecutor.load(hf_model_dir("llama"), dtype=dtype, weight_parts=0)
        for i, layer in flat.state["layers"].items():
            qkv = layer["self_attn"]["qkv_proj"]["weight"][...]
            assert qkv.unsafe_buffer_pointer() == flat.layer_stack.qkv.unsafe_buffer_pointer() + i * qkv.nbytes
            np.testing.assert_array_equal(np.asarray(flat.layer_stack.qkv[i]), np.asarray(qkv))


def test_layer_stacks_lay_matrices_out_in_per_thread_parts():
    """Each part of a layer holds its share of the four matrices one after another; the parts of a matrix, joined,
    are the matrix."""
    shapes = [(96, 64), (64, 32), (160, 64), (64, 80)]  # 3, 2, 5, 2 blocks of 32 rows
    layout = cpu_kernels.part_layout(shapes, jnp.float32, parts=2)
    kinds = {("m", i): i for i in range(4)}
    stacks = LayerStacks(HugePageArena(chunk_bytes=4 << 20), num_layers=2, parts=(layout, kinds))
    rng = np.random.default_rng(1)
    packed = {(layer, i): cpu_kernels.pack_weight(rng.standard_normal(shape).astype(np.float32))
              for layer in range(2) for i, shape in enumerate(shapes)}
    for (layer, i), matrix in packed.items():
        assert stacks.place(("m", i), layer, matrix).size == 0  # the layer's own is a placeholder
    regions = np.asarray(stacks.matrix_parts())
    assert regions.shape == (2, 2, layout.layer_units)
    for (layer, i), matrix in packed.items():
        units = matrix[0].size
        pieces, sizes = [], []
        for p in range(2):
            start = sum((layout.begins[j][p + 1] - layout.begins[j][p]) * layout.block_units[j] for j in range(i))
            blocks = layout.begins[i][p + 1] - layout.begins[i][p]
            sizes.append(blocks)
            pieces.append(regions[p, layer, start: start + blocks * units].reshape(blocks, *matrix.shape[1:]))
        np.testing.assert_array_equal(np.concatenate(pieces), matrix)
        assert abs(sizes[0] - sizes[1]) <= 1


def test_layer_stacks_hold_every_layer_once():
    arena = HugePageArena(chunk_bytes=4 << 20)
    stacks = LayerStacks(arena, num_layers=3)
    rng = np.random.default_rng(0)
    weights = [rng.integers(0, 1 << 31, (6, 288, 32), dtype=np.int64).astype(np.uint32) for _ in range(3)]
    norms = [rng.standard_normal(576).astype(np.float32) for _ in range(3)]
    placed = []
    for layer in (2, 0, 1):  # any order
        placed.append(stacks.place(("w",), layer, weights[layer]))
        placed.append(stacks.place(("norm",), layer, norms[layer]))
        assert (stacks.stacked() is None) == (layer != 1)  # whole only once every layer is in
    stacked = stacks.stacked()
    np.testing.assert_array_equal(np.asarray(stacked[("w",)]), np.stack(weights))
    np.testing.assert_array_equal(np.asarray(stacked[("norm",)]), np.stack(norms))
    for array, layer, kind in zip(placed, (2, 2, 0, 0, 1, 1), [("w",), ("norm",)] * 3, strict=True):
        assert array.unsafe_buffer_pointer() == stacked[kind].unsafe_buffer_pointer() + layer * array.nbytes
    # A layer whose parameter has another shape cannot be stacked: it is still placed, but there are no stacks.
    odd = LayerStacks(arena, num_layers=2)
    odd.place(("w",), 0, weights[0])
    np.testing.assert_array_equal(np.asarray(odd.place(("w",), 1, weights[1][:3])), weights[1][:3])
    assert odd.stacked() is None
    # bfloat16 (no zero-copy view from numpy) is placed as usual, with no stack reserved for it.
    bf16 = LayerStacks(arena, num_layers=2)
    offset = arena._offset
    small = rng.standard_normal((4, 64)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(bf16.place(("w",), 0, small)), small)
    assert bf16.stacked() is None and arena._offset == offset
