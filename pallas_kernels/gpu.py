"""Ragged paged attention for GPUs: a Pallas kernel for the Triton backend (see docs/kernels.md).

One program per (query block, KV head). The block's queries for the whole GQA group sit in one [M, D] tile
(M = group_pad * block_q rows, see blocks.py) so each K/V page is read from HBM once per block and serves every
query head that shares it. The program walks the sequence's pages through the page table, `pages_per_step`
pages per step gathered into one [pages_per_step * B, D] tile, with an online softmax in float32; Triton
software-pipelines the loads of step i + 1 under the math of step i (num_stages).

K/V stay in the engine's layout [N, B, Hkv, D]: a page of one head is B rows of D contiguous elements (256 bytes
at D = 128 in bf16), strided by Hkv * D, which coalesces into full 128-byte transactions.

Triton tiles need power-of-two extents, so a head_dim that is not a power of two runs as its binary digits, largest
first (96 = 64 + 32, 576 = 512 + 64): q, each K/V page's slice of the last axis, the accumulator and the output are
one tile per chunk, and the score is the sum of the chunks' dots. A power-of-two head_dim is one chunk.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.blocks import (
    MASK_VALUE,
    block_metadata,
    first_visible_key,
    pack_q,
    pack_sinks,
    sink_weights,
    unpack_out,
)
from pallas_kernels.quantized import QuantizedPages


def _precision(dtype) -> tuple[lax.Precision, lax.Precision] | None:
    """f32 inputs would default to TF32 tensor-core math on Ampere and later (~1e-3 error): HIGHEST keeps IEEE f32.
    bf16 inputs take the default, the bf16 tensor cores (HIGHEST there asks Triton for IEEE math on CUDA cores)."""
    return (lax.Precision.HIGHEST, lax.Precision.HIGHEST) if jnp.dtype(dtype) == jnp.float32 else None


TILE_ELEMENTS = 64 * 256  # the most elements of a query or K/V tile the default block sizes give (see below)


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _prev_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def head_dim_chunks(head_dim: int) -> tuple[tuple[int, int], ...]:
    """(offset, width) of each power-of-two chunk of head_dim, largest first: its binary decomposition. Every chunk
    is the K of a QK^T dot, which Triton needs >= 16."""
    widths = [1 << bit for bit in reversed(range(head_dim.bit_length())) if head_dim >> bit & 1]
    if len(widths) > 1 and widths[-1] < 16:
        raise ValueError(f"head_dim {head_dim} = {' + '.join(map(str, widths))}: the Triton kernel runs it as these "
                         f"power-of-two chunks, and a chunk narrower than 16 cannot be a tl.dot operand")
    offsets = [sum(widths[:i]) for i in range(len(widths))]
    return tuple(zip(offsets, widths, strict=True))


def takes_head_dim(head_dim: int) -> bool:
    """Whether the kernel tiles this head_dim (head_dim_chunks)."""
    try:
        head_dim_chunks(head_dim)
    except ValueError:
        return False
    return True


def _attend_page(qs, ks, vs, carry, key_pos0, row_pos, k_scale=None, v_scale=None, *, scale, soft_cap,
                 sliding_window, attention_chunk):
    """One online-softmax step of the query tiles ([M, width] per head_dim chunk) against one [N, width] tile of
    keys and of values per chunk. Quantized pages bring each key's and value's scale ([N] float32): they multiply
    the score and probability columns."""
    accs, m_prev, l_prev = carry
    s = functools.reduce(operator.add, (
        lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_precision(k.dtype),
                        preferred_element_type=jnp.float32) for q, k in zip(qs, ks, strict=True))) * scale
    if k_scale is not None:
        s = s * k_scale[None, :]
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    key_pos = key_pos0 + jnp.arange(s.shape[1], dtype=jnp.int32)
    mask = key_pos[None, :] <= row_pos[:, None]
    if sliding_window is not None or attention_chunk is not None:
        mask &= key_pos[None, :] >= first_visible_key(row_pos, sliding_window, attention_chunk)[:, None]
    s = jnp.where(mask, s, MASK_VALUE)
    m_next = jnp.maximum(m_prev, s.max(axis=1))
    p = jnp.exp(s - m_next[:, None])
    correction = jnp.exp(m_prev - m_next)
    weights = p if v_scale is None else p * v_scale[None, :]  # the row sum below stays that of p
    accs = tuple(acc * correction[:, None] + lax.dot_general(
        weights.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=_precision(v.dtype),
        preferred_element_type=jnp.float32) for acc, v in zip(accs, vs, strict=True))
    return accs, m_next, l_prev * correction + p.sum(axis=1)


def _kernel(seq_ref, q_pos_ref, kv_end_ref, page_table_ref, *refs, chunks: tuple[tuple[int, int], ...],
            scale: float, block_q: int, pages_per_step: int, kv_splits: int, sliding_window: int | None,
            attention_chunk: int | None,
            soft_cap: float | None, compute_dtype: jnp.dtype | None, has_sinks: bool):
    # refs: one q tile per head_dim chunk, the K and V pages; for quantized pages (compute_dtype set) two scale refs
    # ([N, B, Hkv] float32); with has_sinks (kv_splits == 1 only) the [M] sinks of the tile's rows; then the
    # outputs: one tile per chunk, or with kv_splits > 1 one acc partial per chunk, m and denom.
    q_refs, (k_ref, v_ref, *refs) = refs[:len(chunks)], refs[len(chunks):]
    k_scale_ref, v_scale_ref, *refs = refs if compute_dtype is not None else (None, None, *refs)
    sink_ref, *out_refs = refs if has_sinks else (None, *refs)
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq, q_pos, kv_end = seq_ref[b], q_pos_ref[b], kv_end_ref[b]
    page_size = k_ref.shape[1]
    qs = tuple(q_ref[...] for q_ref in q_refs)
    rows = qs[0].shape[0]
    row_pos = q_pos + jnp.arange(rows, dtype=jnp.int32) % block_q
    first_page = first_visible_key(q_pos, sliding_window, attention_chunk) // page_size
    last_page = (kv_end + page_size - 1) // page_size
    num_steps = (last_page - first_page + pages_per_step - 1) // pages_per_step
    # Split s of kv_splits takes its own contiguous run of the steps (an empty run writes an empty partial).
    steps_per_split = (num_steps + kv_splits - 1) // kv_splits
    begin = split * steps_per_split
    end = jnp.minimum(begin + steps_per_split, num_steps)
    attend = functools.partial(_attend_page, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
                               attention_chunk=attention_chunk)
    block_k = pages_per_step * page_size

    def body(i, carry):
        first = first_page + i * pages_per_step
        # Past the last page, re-read it: the load stays in bounds with finite data, and the mask drops it.
        js = jnp.minimum(first + jnp.arange(pages_per_step, dtype=jnp.int32), last_page - 1)
        pages = page_table_ref[seq, js]
        # A gather of whole pages: one [block_k, width] tile per chunk, a static slice of the last axis.
        ks = tuple(k_ref[pages, :, h, pl.ds(offset, width)].reshape(block_k, width) for offset, width in chunks)
        vs = tuple(v_ref[pages, :, h, pl.ds(offset, width)].reshape(block_k, width) for offset, width in chunks)
        if compute_dtype is None:
            return attend(qs, ks, vs, carry, first * page_size, row_pos)
        # int8 / e4m3 values convert exactly to the compute dtype; their scales apply to the score columns
        k_scale = k_scale_ref[pages, :, h].reshape(block_k)
        v_scale = v_scale_ref[pages, :, h].reshape(block_k)
        ks, vs = (tuple(x.astype(compute_dtype) for x in xs) for xs in (ks, vs))
        return attend(qs, ks, vs, carry, first * page_size, row_pos, k_scale, v_scale)

    init = (tuple(jnp.zeros((rows, width), jnp.float32) for _, width in chunks),
            jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32))
    accs, m, denom = lax.fori_loop(begin, end, body, init)
    if kv_splits > 1:  # unnormalized partials, merged by _merge_splits
        *acc_refs, m_ref, denom_ref = out_refs
        for acc_ref, acc in zip(acc_refs, accs, strict=True):
            acc_ref[...] = acc
        m_ref[...] = m
        denom_ref[...] = denom
    elif sink_ref is not None:
        weight, sink_term = sink_weights(m, sink_ref[...])
        for o_ref, acc in zip(out_refs, accs, strict=True):
            o_ref[...] = acc * (weight / (denom * weight + sink_term))[:, None]
    else:
        for o_ref, acc in zip(out_refs, accs, strict=True):
            o_ref[...] = acc / jnp.where(denom == 0, 1.0, denom)[:, None]  # padding blocks (no keys) write zeros


def _merge_splits(acc: jax.Array, m: jax.Array, denom: jax.Array, sinks: jax.Array | None = None) -> jax.Array:
    """Online-softmax partials over axis 2 (acc [NB, Hkv, splits, M, D], m and denom [NB, Hkv, splits, M]) ->
    normalized [NB, Hkv, M, D]. Sinks ([Hkv, M], pack_sinks) join here, once per row, not once per split."""
    m_max = m.max(axis=2, keepdims=True)
    if sinks is not None:  # the sink is one more partial: logit max sinks, denominator 1, numerator 0
        m_max = jnp.maximum(m_max, sinks[None, :, None, :])
    weight = jnp.exp(m - m_max)  # empty splits carry MASK_VALUE: weight 0 beside any real split
    num = (acc * weight[..., None]).sum(axis=2)
    den = (denom * weight).sum(axis=2)
    if sinks is not None:  # den >= e^0 for the largest of the sink and the splits' maxima: no division by zero
        return num / (den + jnp.exp(sinks[None] - m_max[:, :, 0]))[..., None]
    return num / jnp.where(den == 0, 1.0, den)[..., None]


def auto_kv_splits(num_programs: int, target_programs: int = 256, max_splits: int = 16) -> int:
    """Splits of each sequence's keys so that about target_programs programs run (a bit under two per SM of an
    H100): a lone decode is Hkv programs, far too few to stream its keys at the memory's rate."""
    if num_programs >= target_programs:
        return 1
    return min(max_splits, _next_pow2(-(-target_programs // num_programs)))


def ragged_paged_attention_gpu(q: jax.Array, k_pages: jax.Array | QuantizedPages, v_pages: jax.Array | QuantizedPages,
                               page_table: jax.Array,
                               query_start: jax.Array, seq_lens: jax.Array, *, scale: float,
                               sliding_window: int | None = None, soft_cap: float | None = None,
                               block_q: int | None = None, pages_per_step: int | None = None,
                               kv_splits: int | None = None, sinks: jax.Array | None = None,
                               num_warps: int = 4, num_stages: int = 2, interpret: bool = False,
                               attention_chunk: int | None = None) -> jax.Array:
    """Triton-backend kernel with the interface of `ragged_paged_attention` (spec in pallas_kernels/interface.py).

    block_q: query tokens per block (a power of two; raised so the tile has >= 16 rows, tl.dot's minimum). None:
    16 where the bucket has more tokens than sequence rows (prefill chunks reuse each K/V tile over 16 tokens),
    else the fewest that fill 16 rows (a decode block holds one token: its other rows would be wasted work); fewer
    where the [rows, head_dim] tile would pass TILE_ELEMENTS.
    pages_per_step: pages gathered per loop step; their pages_per_step * page_size keys are the N of the QK^T
    tile (a power of two). None: 64 keys (4 pages of 16), which keeps the tensor cores fed while the registers
    hold [M, N] scores; larger tiles of D = 128 overflow shared memory (seen: page 64 x 4 pages on an H200); fewer
    where a [keys, head_dim] tile would pass TILE_ELEMENTS.
    kv_splits: programs per (block, KV head), each over its own run of the keys, merged after the kernel (flash
    decoding). None: auto_kv_splits of the grid, so small decode batches still stream at the memory's rate.
    Quantized pages (QuantizedPages, int8 or float8_e4m3fn values, not uint8 bits) are read as stored and
    converted to their compute dtype per tile; each key's scale multiplies its score, each value's its probability.
    sinks (float32 [H]): each query head's attention sink, which joins the softmax where it is normalized: in the
    kernel when kv_splits == 1, else in the merge of the splits.
    """
    quantized = isinstance(k_pages, QuantizedPages)
    compute_dtype = jnp.dtype(k_pages.dtype) if quantized else None
    scales = (k_pages.scales, v_pages.scales) if quantized else ()
    if quantized:
        k_pages, v_pages = k_pages.values, v_pages.values
    num_tokens, num_heads, head_dim = q.shape
    chunks = head_dim_chunks(head_dim)
    num_kv_heads = k_pages.shape[2]
    num_seqs = seq_lens.shape[0]
    page_size = k_pages.shape[1]
    # Tiles of at most TILE_ELEMENTS (64 x 256: Gemma's widest, run on an H200) elements: a head as wide as latent
    # attention's 576 takes fewer keys a step and fewer query tokens a block, or its K/V and query tiles would not
    # fit in shared memory (64 keys x 576 x 2 bytes is 72 KB a tile, twice for V, twice again pipelined).
    keys = max(16, _prev_pow2(TILE_ELEMENTS // head_dim))
    if pages_per_step is None:
        pages_per_step = max(1, min(64, keys) // page_size)
    group_pad = _next_pow2(num_heads // num_kv_heads)  # Triton tiles need power-of-two extents
    if block_q is None:
        block_q = min(16 if num_tokens > num_seqs else 1, max(1, _prev_pow2(keys // group_pad)))
    block_q = max(block_q, 16 // group_pad)  # tl.dot needs M >= 16
    meta = block_metadata(query_start, seq_lens, num_tokens, block_q)
    q_dtype = k_pages.dtype if compute_dtype is None else compute_dtype
    q_packed = pack_q(q.astype(q_dtype), meta, num_kv_heads, block_q, group_pad)
    nb, _, rows, _ = q_packed.shape
    if kv_splits is None:
        kv_splits = auto_kv_splits(nb * num_kv_heads)
    packed_sinks = None if sinks is None else pack_sinks(sinks, num_kv_heads, block_q, group_pad)
    # With one split the kernel normalizes, so it reads its KV head's row of the sinks; splits leave it to the merge.
    kernel_sinks = (packed_sinks,) if packed_sinks is not None and kv_splits == 1 else ()
    # One q tile and one output (or acc partial) per head_dim chunk; the wrapper splits q and joins the outputs.
    q_chunks = jnp.split(q_packed, [offset for offset, _ in chunks[1:]], axis=-1)
    tiles = [pl.BlockSpec((None, None, rows, width), lambda b, h, s: (b, h, 0, 0)) for _, width in chunks]
    whole = pl.no_block_spec
    if kv_splits == 1:
        out_specs = tiles
        out_shape = [jax.ShapeDtypeStruct((nb, num_kv_heads, rows, width), jnp.float32) for _, width in chunks]
    else:
        row_partial = pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0))
        out_specs = [pl.BlockSpec((None, None, None, rows, width), lambda b, h, s: (b, h, s, 0, 0))
                     for _, width in chunks] + [row_partial, row_partial]
        per_row = (nb, num_kv_heads, kv_splits, rows)
        out_shape = [jax.ShapeDtypeStruct((*per_row, width), jnp.float32) for _, width in chunks] \
            + [jax.ShapeDtypeStruct(per_row, jnp.float32)] * 2
    out = pl.pallas_call(
        functools.partial(_kernel, chunks=chunks, scale=scale, block_q=block_q, pages_per_step=pages_per_step,
                          kv_splits=kv_splits, sliding_window=sliding_window, attention_chunk=attention_chunk,
                          soft_cap=soft_cap, compute_dtype=compute_dtype, has_sinks=bool(kernel_sinks)),
        grid=(nb, num_kv_heads, kv_splits),
        in_specs=[whole] * 4 + tiles + [whole] * (2 + len(scales))
        + [pl.BlockSpec((None, rows), lambda b, h, s: (h, 0))] * len(kernel_sinks),
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_triton",
    )(meta.seq, meta.q_pos, meta.kv_end, page_table, *q_chunks, k_pages, v_pages, *scales, *kernel_sinks)
    if kv_splits == 1:
        out = jnp.concatenate(out, axis=-1)
    else:
        out = _merge_splits(jnp.concatenate(out[:-2], axis=-1), *out[-2:], packed_sinks)
    return unpack_out(out, query_start, num_tokens, num_heads, block_q)
