"""Pure-JAX ragged paged attention: the definition of correctness, and the fast path on CPU.

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
    # float32 caches multiply in float32 (a GPU's default for float32 is TF32, a TPU's one bfloat16 pass).
    precision = jax.lax.Precision.HIGHEST if k.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
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
