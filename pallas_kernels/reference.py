"""Pure-JAX ragged paged attention: the definition of correctness (ragged_paged_attention_ref, a dense gather), and
the engine's pure-JAX attention (ragged_paged_attention_chunked: the same result a chunk of pages at a time).

Layout (shared with the kernels):
  q            [T, H, D]        queries of every scheduled token, flattened over sequences
  k_pages      [N, B, Hkv, D]   one layer's key cache: N pages of B token slots (v_pages likewise)
  page_table   [S, P]           page ids of each sequence's logical blocks, padded with any valid id
  token_seq    [T]              the sequence row of each token
  positions    [T]              each token's position in its sequence (its key slot is already written)
Token t attends to key positions 0..positions[t] of its own sequence (causal), and only to the last
`sliding_window` of them when a window is set; `soft_cap` squashes scaled logits to cap * tanh(s / cap); `sinks`
(float32 [H], gpt-oss's attention sinks) adds exp(sinks[h]) to each softmax's denominator, as a key whose value is 0.
Padding tokens point at a valid row and position 0. k_pages / v_pages may be QuantizedPages (quantized.py): the
stored values are gathered, converted to the compute dtype, and each key's scale multiplies its score column, each
value's its probability column.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.blocks import MASK_VALUE, first_visible_key
from pallas_kernels.quantized import QuantizedPages, stored_to_compute, write_quantized


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


def value_dtype(pages: jax.Array | QuantizedPages) -> jnp.dtype:
    """The dtype attention computes in for this cache: its values' (bfloat16 for uint16 bits), or a quantized
    cache's compute dtype."""
    return jnp.dtype(pages.dtype) if isinstance(pages, QuantizedPages) else from_stored(pages[:0]).dtype


def gather_pages(pages: jax.Array | QuantizedPages, index: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """pages[index] as values in the compute dtype [..., B, Hkv, D], and for a quantized cache its scales
    [..., B, Hkv] (None otherwise): only the gathered pages are converted, never the cache."""
    if isinstance(pages, QuantizedPages):
        return stored_to_compute(pages.values[index], pages.dtype), pages.scales[index]
    return from_stored(pages[index]), None


def write_kv_ref(k_pages: jax.Array | QuantizedPages, v_pages: jax.Array | QuantizedPages | None, k: jax.Array,
                 v: jax.Array | None, slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """Scatter new k/v [T, Hkv, D] into flat slots; out-of-range slots (padding tokens) are dropped. A quantized
    cache quantizes each (token, KV head) row with its own scale as it writes it. v_pages None (a cache whose values
    are its keys): only the keys are written."""
    if v_pages is None:
        return write_kv_ref(k_pages, k_pages, k, k, slot_mapping)[0], None
    if isinstance(k_pages, QuantizedPages):
        return write_quantized(k_pages, k, slot_mapping), write_quantized(v_pages, v, slot_mapping)
    num_pages, page_size, kv_heads, head_dim = k_pages.shape
    flat_shape = (num_pages * page_size, kv_heads, head_dim)

    def write(pages: jax.Array, new: jax.Array) -> jax.Array:
        flat = pages.reshape(flat_shape).at[slot_mapping].set(as_stored(new, pages.dtype), mode="drop")
        return flat.reshape(pages.shape)

    return write(k_pages, k), write(v_pages, v)


def _page_shape(pages: jax.Array | QuantizedPages) -> tuple[int, ...]:
    return pages.values.shape if isinstance(pages, QuantizedPages) else pages.shape


def _scale_keys(x: jax.Array, scales: jax.Array | None) -> jax.Array:
    """x [T, Hkv, G, L] times each key's scale (gathered scales [T, ..., Hkv] flatten to [T, L, Hkv]); None: x."""
    if scales is None:
        return x
    num_tokens, kv_heads = x.shape[0], x.shape[1]
    per_key = scales.reshape(num_tokens, -1, kv_heads).transpose(0, 2, 1)  # [T, Hkv, L]
    return x * per_key[:, :, None, :]


def ragged_paged_attention_ref(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                               token_seq: jax.Array, positions: jax.Array, *, scale: float,
                               sliding_window: int | None = None, soft_cap: float | None = None,
                               sinks: jax.Array | None = None, attention_chunk: int | None = None) -> jax.Array:
    """Attention of each token over its own sequence's cached keys; returns float32 [T, H, D]. A quantized cache
    (QuantizedPages) scales each key's score and each value's probability by its row's scale."""
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = _page_shape(k_pages)
    group = num_heads // kv_heads
    token_pages = page_table[token_seq]  # [T, P]: each token reads only its own sequence's pages
    width = token_pages.shape[1] * page_size
    k, k_scale = gather_pages(k_pages, token_pages)
    v, v_scale = gather_pages(v_pages, token_pages)
    k = k.reshape(num_tokens, width, kv_heads, head_dim)
    v = v.reshape(num_tokens, width, kv_heads, head_dim)
    qg = q.reshape(num_tokens, kv_heads, group, head_dim).astype(k.dtype)
    precision = dot_precision(k.dtype)
    scores = jnp.einsum("tkgd,tlkd->tkgl", qg, k, precision=precision, preferred_element_type=jnp.float32) * scale
    scores = _scale_keys(scores, k_scale)
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    key_pos = jnp.arange(width, dtype=jnp.int32)[None, :]
    mask = (key_pos <= positions[:, None]) & (key_pos >= first_visible_key(positions[:, None], sliding_window,
                                                                             attention_chunk))
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:  # the sink is one more logit in the softmax, its probability dropped (transformers' eager gpt-oss)
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kv_heads, group, 1), (*scores.shape[:3], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    probs = _scale_keys(probs, v_scale)
    out = jnp.einsum("tkgl,tlkd->tkgd", probs.astype(v.dtype), v, precision=precision,
                     preferred_element_type=jnp.float32)
    return out.reshape(num_tokens, num_heads, head_dim)


def ragged_paged_attention_chunked(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                                   token_seq: jax.Array, positions: jax.Array, *, scale: float,
                                   sliding_window: int | None = None, soft_cap: float | None = None,
                                   sinks: jax.Array | None = None, pages_per_chunk: int = 8,
                                   attention_chunk: int | None = None) -> jax.Array:
    """ragged_paged_attention_ref's result, walking the page table `pages_per_chunk` columns at a time with an
    online softmax, up to the chunk of the furthest position in the batch (a data-dependent loop): its cost follows
    the longest sequence, not the table's width, so one full-width table serves every step."""
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = _page_shape(k_pages)
    group = num_heads // kv_heads
    chunk = min(pages_per_chunk, page_table.shape[1])
    if page_table.shape[1] % chunk:  # whole chunks; the extra columns lie past every sequence and are masked
        page_table = jnp.pad(page_table, ((0, 0), (0, chunk - page_table.shape[1] % chunk)))
    width = chunk * page_size
    compute_dtype = value_dtype(k_pages)
    qg = q.reshape(num_tokens, kv_heads, group, head_dim).astype(compute_dtype)
    precision = dot_precision(compute_dtype)
    # chunks of pages wholly before every token's first visible key (its window's, its attention chunk's) hold nothing
    first = first_visible_key(jnp.min(positions), sliding_window, attention_chunk) // width
    last = jnp.max(positions) // width + 1

    def body(i, carry):
        acc, m_prev, l_prev = carry
        pages = jax.lax.dynamic_slice_in_dim(page_table, i * chunk, chunk, axis=1)[token_seq]  # [T, chunk]
        k, k_scale = gather_pages(k_pages, pages)
        v, v_scale = gather_pages(v_pages, pages)
        k = k.reshape(num_tokens, width, kv_heads, head_dim)
        v = v.reshape(num_tokens, width, kv_heads, head_dim)
        s = jnp.einsum("tkgd,tlkd->tkgl", qg, k, precision=precision, preferred_element_type=jnp.float32) * scale
        s = _scale_keys(s, k_scale)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        key_pos = i * width + jnp.arange(width, dtype=jnp.int32)[None, :]
        mask = (key_pos <= positions[:, None]) & (key_pos >= first_visible_key(positions[:, None], sliding_window,
                                                                                 attention_chunk))
        s = jnp.where(mask[:, None, None, :], s, MASK_VALUE)
        m_next = jnp.maximum(m_prev, s.max(axis=-1))
        p = jnp.exp(s - m_next[..., None])
        correction = jnp.exp(m_prev - m_next)
        pv = jnp.einsum("tkgl,tlkd->tkgd", _scale_keys(p, v_scale).astype(v.dtype), v, precision=precision,
                        preferred_element_type=jnp.float32)
        return acc * correction[..., None] + pv, m_next, l_prev * correction + p.sum(axis=-1)

    init = (jnp.zeros((num_tokens, kv_heads, group, head_dim), jnp.float32),
            jnp.full((num_tokens, kv_heads, group), MASK_VALUE, jnp.float32),
            jnp.zeros((num_tokens, kv_heads, group), jnp.float32))
    acc, m, denom = jax.lax.fori_loop(first, last, body, init)
    if sinks is not None:  # each token sees at least its own key, so m is a real score
        denom = denom + jnp.exp(sinks.astype(jnp.float32).reshape(1, kv_heads, group) - m)
    return (acc / denom[..., None]).reshape(num_tokens, num_heads, head_dim)
