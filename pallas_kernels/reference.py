"""Pure-JAX ragged paged attention: the definition of correctness, and the fast path on CPU.

Layout (shared with the kernels):
  q            [T, H, D]        queries of every scheduled token, flattened over sequences
  k_pages      [N, B, Hkv, D]   one layer's key cache: N pages of B token slots (v_pages likewise)
  page_table   [S, P]           page ids of each sequence's logical blocks, padded with any valid id
  token_seq    [T]              the sequence row of each token
  positions    [T]              each token's position in its sequence (its key slot is already written)
Token t attends to key positions 0..positions[t] of its own sequence (causal), and only to the last
`sliding_window` of them when a window is set. Padding tokens point at a valid row and position 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def write_kv_ref(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array,
                 slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scatter new k/v [T, Hkv, D] into flat slots; out-of-range slots (padding tokens) are dropped."""
    num_pages, page_size, kv_heads, head_dim = k_pages.shape
    flat_shape = (num_pages * page_size, kv_heads, head_dim)
    k_pages = k_pages.reshape(flat_shape).at[slot_mapping].set(k.astype(k_pages.dtype), mode="drop")
    v_pages = v_pages.reshape(flat_shape).at[slot_mapping].set(v.astype(v_pages.dtype), mode="drop")
    return k_pages.reshape(num_pages, page_size, kv_heads, head_dim), v_pages.reshape(
        num_pages, page_size, kv_heads, head_dim)


def ragged_paged_attention_ref(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                               token_seq: jax.Array, positions: jax.Array, *, scale: float,
                               sliding_window: int | None = None) -> jax.Array:
    """Attention of each token over its own sequence's cached keys; returns float32 [T, H, D]."""
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    group = num_heads // kv_heads
    token_pages = page_table[token_seq]  # [T, P]: each token reads only its own sequence's pages
    width = token_pages.shape[1] * page_size
    k = k_pages[token_pages].reshape(num_tokens, width, kv_heads, head_dim)
    v = v_pages[token_pages].reshape(num_tokens, width, kv_heads, head_dim)
    qg = q.reshape(num_tokens, kv_heads, group, head_dim).astype(k.dtype)
    scores = jnp.einsum("tkgd,tlkd->tkgl", qg, k, preferred_element_type=jnp.float32) * scale
    key_pos = jnp.arange(width, dtype=jnp.int32)[None, :]
    mask = key_pos <= positions[:, None]
    if sliding_window is not None:
        mask &= key_pos > positions[:, None] - sliding_window
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("tkgl,tlkd->tkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(num_tokens, num_heads, head_dim)
