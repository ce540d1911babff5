"""Work list shared by the kernels: a ragged batch cut into query blocks that each belong to one sequence.

A kernel program handles one query block (up to `block_q` consecutive tokens of a single sequence) for one KV
head. Cutting the ragged batch into per-sequence blocks in XLA, before the kernel, keeps the kernels simple and
regular: their q/out tiles are plain BlockSpecs (no data-dependent query offsets, no masked stores that could
clobber a neighbouring sequence's rows), and all raggedness left inside a kernel is the KV loop length.

The cost is one gather of q in and one of the output back, O(T * H * D) elements: small next to the KV pages a
step reads, O(sum(kv_len) * Hkv * D), except for prefill of very short prompts.

Packed q layout, per block b and KV head h: rows r = g * block_q + i for query head g of the group (padded to
`group_pad` heads) and token i of the block. Head-major rows make a row's token index `r % block_q`, a bit mask
when block_q is a power of two (vector integer division is best avoided in kernels), and give the GQA group one
matmul with M = group_pad * block_q rows against each K tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

# The masked logit of every online softmax here: finite, so a fully masked tile or chunk never makes NaNs.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@jax.tree_util.register_dataclass
@dataclass
class BlockMeta:
    """Per query block metadata (all i32[NB]); padding blocks have kv_end == 0 and compute nothing."""

    seq: jax.Array  # sequence row of the block (its page_table row)
    q_pos: jax.Array  # position in its sequence of the block's first token
    kv_end: jax.Array  # keys [0, kv_end) can be seen by the block: last valid token's position + 1
    token: jax.Array  # index in q of the block's first token


def row_of(ends: jax.Array, items: jax.Array) -> jax.Array:
    """For each item, how many of the sorted `ends` are <= it: the row whose [begin, end) range holds the item.

    An unrolled binary search (log2 of len(ends) levels of gathers that XLA fuses): searchsorted's default method
    is a while loop, which a compiled step runs level by level, testing the loop's condition at each.
    """
    return jnp.searchsorted(ends, items, side="right", method="scan_unrolled")


def num_blocks(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Static upper bound on query blocks: each sequence adds at most one partial block; each block holds a token."""
    return max(1, min(num_tokens, -(-num_tokens // block_q) + num_seqs))


def block_metadata(query_start: jax.Array, seq_lens: jax.Array, num_tokens: int, block_q: int) -> BlockMeta:
    num_seqs = seq_lens.shape[0]
    nb = num_blocks(num_tokens, num_seqs, block_q)
    q_lens = query_start[1:] - query_start[:-1]
    blocks_per_seq = (q_lens + block_q - 1) // block_q
    block_end = jnp.cumsum(blocks_per_seq)
    block_begin = block_end - blocks_per_seq
    b = jnp.arange(nb, dtype=jnp.int32)
    seq = jnp.minimum(row_of(block_end, b), num_seqs - 1).astype(jnp.int32)
    local = b - block_begin[seq]
    valid = b < block_end[-1]
    first = local * block_q
    n_valid = jnp.clip(q_lens[seq] - first, 0, block_q)
    q_pos = seq_lens[seq] - q_lens[seq] + first
    return BlockMeta(seq=jnp.where(valid, seq, 0), q_pos=jnp.where(valid, q_pos, 0),
                     kv_end=jnp.where(valid, q_pos + n_valid, 0),
                     token=jnp.where(valid, query_start[seq] + first, 0).astype(jnp.int32))


def pack_q(q: jax.Array, meta: BlockMeta, num_kv_heads: int, block_q: int, group_pad: int) -> jax.Array:
    """q [T, H, D] -> [NB, Hkv, group_pad * block_q, D] (rows head-major, see module doc)."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    idx = jnp.minimum(meta.token[:, None] + jnp.arange(block_q, dtype=jnp.int32), num_tokens - 1)
    qb = q[idx].reshape(-1, block_q, num_kv_heads, group, head_dim)
    if group_pad > group:
        qb = jnp.pad(qb, ((0, 0), (0, 0), (0, 0), (0, group_pad - group), (0, 0)))
    return qb.transpose(0, 2, 3, 1, 4).reshape(-1, num_kv_heads, group_pad * block_q, head_dim)


def pack_sinks(sinks: jax.Array, num_kv_heads: int, block_q: int, group_pad: int) -> jax.Array:
    """Attention sinks [H] (model head order) -> float32 [Hkv, group_pad * block_q]: the sink of each packed q row
    (row g * block_q + i is query head h * group + g of KV head h); padded heads' rows get 0 (their output is
    dropped)."""
    group = sinks.shape[0] // num_kv_heads
    per_head = sinks.astype(jnp.float32).reshape(num_kv_heads, group)
    if group_pad > group:
        per_head = jnp.pad(per_head, ((0, 0), (0, group_pad - group)))
    return jnp.repeat(per_head, block_q, axis=1)


def sink_weights(m: jax.Array, sink: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The end of an online softmax whose rows have an attention sink: one more logit with a zero value. Returns
    (weight, sink_term) with out = acc * weight / (denom * weight + sink_term), all taken relative to max(m, sink)
    so that exp stays in range even for a sink far above every score; a row with no keys (m = MASK_VALUE:
    padding) gets weight 0 and sink_term 1, a zero output rather than a NaN."""
    top = jnp.maximum(m, sink)
    return jnp.exp(m - top), jnp.exp(sink - top)


def unpack_out(out: jax.Array, query_start: jax.Array, num_tokens: int, num_heads: int, block_q: int) -> jax.Array:
    """[NB, Hkv, group_pad * block_q, D] -> [T, H, D]; tokens past the last sequence (padding) get zeros."""
    nb, num_kv_heads, rows, head_dim = out.shape
    group, group_pad = num_heads // num_kv_heads, rows // block_q
    ob = out.reshape(nb, num_kv_heads, group_pad, block_q, head_dim)[:, :, :group]
    flat = ob.transpose(0, 3, 1, 2, 4).reshape(nb * block_q, num_heads, head_dim)
    num_seqs = query_start.shape[0] - 1
    q_lens = query_start[1:] - query_start[:-1]
    blocks_per_seq = (q_lens + block_q - 1) // block_q
    block_begin = jnp.cumsum(blocks_per_seq) - blocks_per_seq
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.minimum(row_of(query_start[1:], t), num_seqs - 1)
    local = t - query_start[seq]
    row = (block_begin[seq] + local // block_q) * block_q + local % block_q
    real = t < query_start[num_seqs]
    return jnp.where(real[:, None, None], flat[jnp.where(real, row, 0)], 0)


def first_visible_key(pos, sliding_window: int | None, attention_chunk: int | None):
    """The first key position a query at `pos` (non-negative int32) sees: the oldest of its sliding window, the
    first of its chunk (chunked attention, Llama 4's: a query sees the keys of its own chunk of attention_chunk
    positions), else 0. Truncating division: pos is non-negative, and floor division lowers through sign(), whose
    Mosaic rule needs to know the TPU generation."""
    if sliding_window is not None:
        return jnp.maximum(pos - sliding_window + 1, 0)
    if attention_chunk is not None:
        return lax.div(pos, jnp.int32(attention_chunk)) * attention_chunk
    return 0
