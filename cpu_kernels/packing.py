"""The kernels' packed weight layout: a matrix laid out once at load so that every matmul reads it front to back
(float32 and bfloat16 panels, int8 with its scales inside each block), and reads of it (rows of a packed embedding
table). The C++ side: matmul_blocks.h, matmul_packed.h, matmul_int8.h."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

PACKED_ROWS = 32  # weight rows per packed block (two 16-row panels: matmul_blocks.h); N is padded to whole blocks


def pack_weight(w: np.ndarray) -> np.ndarray:
    """A [N, K] weight in the kernels' packed layout: N padded to a multiple of 32 and block b holding rows
    32b .. 32b + 31 k-major: bfloat16 (K even) as uint32 [N_pad / 32, K / 2, 32] pairs (w[n, 2k], w[n, 2k + 1]),
    float32 as float32 [N_pad / 32, K, 32]. Packed once, the weight is read front to back by every matmul."""
    n, k = w.shape
    if w.dtype not in (jnp.bfloat16, jnp.float32) or (w.dtype == jnp.bfloat16 and k % 2):
        raise ValueError(f"pack_weight: a float32 or bfloat16 [N, K] weight (K even) expected, got {w.shape} "
                         f"{w.dtype}")
    n_pad = -(-n // PACKED_ROWS) * PACKED_ROWS
    if w.dtype == jnp.float32:
        rows = np.zeros((n_pad, k), np.float32)
        rows[:n] = w
    else:
        bits = np.zeros((n_pad, k), np.uint16)
        bits[:n] = np.asarray(w).view(np.uint16)
        rows = bits.view(np.uint32)  # [N_pad, K / 2]: little-endian, so the low half is the even k
    return np.ascontiguousarray(rows.reshape(n_pad // PACKED_ROWS, PACKED_ROWS, -1).transpose(0, 2, 1))


INT8_SCALE_ROWS = 4  # an int8 block's 32 float32 scales: 128 bytes, 4 rows of its [K + 4, 32] bytes


def pack_weight_int8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """An int8 [N, K] weight and its float32 [N] per-row scales (jserve.models.quantization: w = q * scale) in the
    kernels' packed layout, int8 [N_pad / 32, K + 4, 32]: block b holds rows 32b .. 32b + 31 k-major (w[32b + j, k]
    at byte 32 k + j), then their 32 scales as float32 bytes (padding rows: zero weights, zero scales). The kernels
    widen each int8 in registers and multiply each output by its row's scale once, after the sum (matmul_int8.h)."""
    n, k = q.shape
    if q.dtype != np.int8 or scale.shape != (n,):
        raise ValueError(f"pack_weight_int8: an int8 [N, K] weight and float32 [N] scales expected, got {q.shape} "
                         f"{q.dtype} and {scale.shape}")
    blocks = -(-n // PACKED_ROWS)
    rows = np.zeros((blocks * PACKED_ROWS, k), np.int8)
    rows[:n] = q
    scales = np.zeros((blocks * PACKED_ROWS,), np.float32)
    scales[:n] = scale
    out = np.empty((blocks, k + INT8_SCALE_ROWS, PACKED_ROWS), np.int8)
    out[:, :k] = rows.reshape(blocks, PACKED_ROWS, k).transpose(0, 2, 1)
    out[:, k:] = scales.reshape(blocks, PACKED_ROWS).view(np.int8).reshape(blocks, INT8_SCALE_ROWS, PACKED_ROWS)
    return out


def is_packed(w: jax.Array) -> bool:
    return w.ndim == 3 and w.shape[2] == PACKED_ROWS and w.dtype in (jnp.uint32, jnp.float32, jnp.int8)


def packed_rows(w: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows ids[T] of a packed weight as float32 [T, K] (an embedding lookup in a tied, packed table); an int8 one's
    times their scales."""
    if w.dtype == jnp.int8:
        k = w.shape[1] - INT8_SCALE_ROWS
        q = w[ids // PACKED_ROWS, :k, ids % PACKED_ROWS].astype(jnp.float32)  # [T, K]
        scale_bytes = w[ids // PACKED_ROWS, k:, :].reshape(ids.shape[0], PACKED_ROWS, 4)  # each block's 32 floats
        scales = jax.lax.bitcast_convert_type(scale_bytes, jnp.float32)  # [T, 32]
        return q * jnp.take_along_axis(scales, (ids % PACKED_ROWS)[:, None], axis=1)
    rows = w[ids // PACKED_ROWS, :, ids % PACKED_ROWS]  # [T, K / 2] uint32 pairs, or [T, K] float32
    if w.dtype == jnp.float32:
        return rows
    halves = jax.lax.bitcast_convert_type(rows, jnp.uint16)  # [T, K / 2, 2], low half first
    return jax.lax.bitcast_convert_type(halves.reshape(ids.shape[0], -1), jnp.bfloat16).astype(jnp.float32)


def is_packed_stack(w: jax.Array) -> bool:
    """A stack of packed weights, [E, ...] of pack_weight's or pack_weight_int8's (a mixture of experts' matrices)."""
    return w.ndim == 4 and w.shape[3] == PACKED_ROWS and w.dtype in (jnp.uint32, jnp.float32, jnp.int8)
