"""Pure-JAX ragged paged attention: the definition of correctness (ragged_paged_attention_ref, a dense gather), and
the engine's pure-JAX attention (ragged_paged_attention_chunked: the same result a chunk of pages at a time).

Layout (shared with the kernels):
  q            [T, H, D]        queries of every scheduled token, flattened over sequences
  k_pages      [N, B, Hkv, D]   one layer's key cache: N pages of B token slots (v_pages likewise)
  page_table   [S, P]           page ids of each sequence's logical blocks, padded with any valid id
  token_seq    [T]              the sequence row of each token
  positions    [T]              each token's position in its sequence (its key slot is already written)
Token t attends to key positions 0..positions[t] of its own sequence (causal), and only to the last
`sliding_window` of them when a window is set; `soft_cap` squashes scaled logits to cap * tanh(s / cap).
Padding tokens point at a valid row and position 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.blocks import MASK_VALUE


def dot_precision(dtype: jnp.dtype) -> jax.lax.Precision:
    """float32 operands multiply in float32: a GPU's default for float32 dots is TF32 (10-bit mantissa) and a TPU's
    one bfloat16 pass, either of which would change greedy tokens against a float32 reference. Narrower dtypes
    take the default (their own precision)."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def kv_storage_dtype(dtype: str | jnp.dtype, platform: str) -> jnp.dtype:
    """The KV cache's array dtype: on CPU, bfloat16 K/V are stored as their uint16 bits, because XLA CPU gathers
    and scatters bfloat16 by converting the whole cache to float32 first (a full copy per layer per step),
    while a uint16 gather or in-place scatter moves only the rows it touches."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.uint16) if dtype == jnp.bfloat16 and platform == "cpu" else dtype


def as_stored(x: jax.Array, storage: jnp.dtype) -> jax.Array:
    """Values x in the cache's storage dtype (bfloat16 bits for a uint16 cache)."""
    if storage == jnp.uint16:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    return x.astype(storage)


def from_stored(x: jax.Array) -> jax.Array:
    """Cache contents as values: uint16 holds bfloat16 bits."""
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == jnp.uint16 else x


def write_kv_ref(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array,
                 slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scatter new k/v [T, Hkv, D] into flat slots; out-of-range slots (padding tokens) are dropped."""
    num_pages, page_size, kv_heads, head_dim = k_pages.shape
    flat_shape = (num_pages * page_size, kv_heads, head_dim)

    def write(pages: jax.Array, new: jax.Array) -> jax.Array:
        flat = pages.reshape(flat_shape).at[slot_mapping].set(as_stored(new, pages.dtype), mode="drop")
        return flat.reshape(pages.shape)

    return write(k_pages, k), write(v_pages, v)


def ragged_paged_attention_ref(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                               token_seq: jax.Array, positions: jax.Array, *, scale: float,
                               sliding_window: int | None = None, soft_cap: float | None = None) -> jax.Array:
    """Attention of each token over its own sequence's cached keys; returns float32 [T, H, D]."""
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    group = num_heads // kv_heads
    token_pages = page_table[token_seq]  # [T, P]: each token reads only its own sequence's pages
    width = token_pages.shape[1] * page_size
    k = from_stored(k_pages[token_pages]).reshape(num_tokens, width, kv_heads, head_dim)
    v = from_stored(v_pages[token_pages]).reshape(num_tokens, width, kv_heads, head_dim)
    qg = q.reshape(num_tokens, kv_heads, group, head_dim).astype(k.dtype)
    precision = dot_precision(k.dtype)
    scores = jnp.einsum("tkgd,tlkd->tkgl", qg, k, precision=precision, preferred_element_type=jnp.float32) * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    key_pos = jnp.arange(width, dtype=jnp.int32)[None, :]
    mask = key_pos <= positions[:, None]
    if sliding_window is not None:
        mask &= key_pos > positions[:, None] - sliding_window
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("tkgl,tlkd->tkgd", probs.astype(v.dtype), v, precision=precision,
                     preferred_element_type=jnp.float32)
    return out.reshape(num_tokens, num_heads, head_dim)


def ragged_paged_attention_chunked(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                                   token_seq: jax.Array, positions: jax.Array, *, scale: float,
                                   sliding_window: int | None = None, soft_cap: float | None = None,
                                   pages_per_chunk: int = 8) -> jax.Array:
    """ragged_paged_attention_ref's result, walking the page table `pages_per_chunk` columns at a time with an
    online softmax, up to the chunk of the furthest position in the batch (a data-dependent loop): its cost follows
    the longest sequence, not the table's width, so one full-width table serves every step."""
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    group = num_heads // kv_heads
    chunk = min(pages_per_chunk, page_table.shape[1])
    if page_table.shape[1] % chunk:  # whole chunks; the extra columns lie past every sequence and are masked
        page_table = jnp.pad(page_table, ((0, 0), (0, chunk - page_table.shape[1] % chunk)))
    width = chunk * page_size
    value_dtype = from_stored(k_pages[:0]).dtype
    qg = q.reshape(num_tokens, kv_heads, group, head_dim).astype(value_dtype)
    precision = dot_precision(value_dtype)
    first = 0
    if sliding_window is not None:  # chunks wholly before every token's window hold nothing it sees
        first = jnp.maximum(jnp.min(positions) - sliding_window + 1, 0) // width
    last = jnp.max(positions) // width + 1

    def body(i, carry):
        acc, m_prev, l_prev = carry
        pages = jax.lax.dynamic_slice_in_dim(page_table, i * chunk, chunk, axis=1)[token_seq]  # [T, chunk]
        k = from_stored(k_pages[pages]).reshape(num_tokens, width, kv_heads, head_dim)
        v = from_stored(v_pages[pages]).reshape(num_tokens, width, kv_heads, head_dim)
        s = jnp.einsum("tkgd,tlkd->tkgl", qg, k, precision=precision, preferred_element_type=jnp.float32) * scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        key_pos = i * width + jnp.arange(width, dtype=jnp.int32)[None, :]
        mask = key_pos <= positions[:, None]
        if sliding_window is not None:
            mask &= key_pos > positions[:, None] - sliding_window
        s = jnp.where(mask[:, None, None, :], s, MASK_VALUE)
        m_next = jnp.maximum(m_prev, s.max(axis=-1))
        p = jnp.exp(s - m_next[..., None])
        correction = jnp.exp(m_prev - m_next)
        pv = jnp.einsum("tkgl,tlkd->tkgd", p.astype(v.dtype), v, precision=precision,
                        preferred_element_type=jnp.float32)
        return acc * correction[..., None] + pv, m_next, l_prev * correction + p.sum(axis=-1)

    init = (jnp.zeros((num_tokens, kv_heads, group, head_dim), jnp.float32),
            jnp.full((num_tokens, kv_heads, group), MASK_VALUE, jnp.float32),
            jnp.zeros((num_tokens, kv_heads, group), jnp.float32))
    acc, _, denom = jax.lax.fori_loop(first, last, body, init)
    return (acc / denom[..., None]).reshape(num_tokens, num_heads, head_dim)
