"""Ragged paged attention for TPUs: a Pallas Mosaic kernel (see docs/kernels.md).

One grid step per (KV head, query block). The page table and the block work list are scalar-prefetched into
SMEM, so the kernel knows which pages to fetch before any vector work starts. K/V stay in HBM (memory_space ANY)
in the engine's layout [N, B, Hkv, D]; the kernel copies the pages it needs into VMEM with async DMAs, `pages_per_chunk`
pages per chunk, double buffered: chunk c + 1 is in flight while chunk c is multiplied. The DMA also does the
head de-interleave: it copies the strided [B, D] slab of one KV head of a page into a dense [chunk, D] VMEM
buffer, so the MXU sees plain 2-D tiles and no strided vector loads are needed. Softmax is online, in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

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


def _precision(dtype) -> tuple | None:
    # f32 caches get full-precision MXU passes (not one bf16 pass); bf16 needs no precision attribute.
    return (lax.Precision.HIGHEST, lax.Precision.HIGHEST) if dtype == jnp.float32 else None


def _chunk_copies(k_hbm, v_hbm, k_buf, v_buf, sems, page_table_ref, scale_refs, *, row, h, first_page, last_page,
                  chunk, slot, pages_per_chunk, pages_per_seq):
    """The DMA descriptors that bring KV chunk `chunk` of head h into buffer `slot` (start, then wait, each);
    scale_refs: for quantized pages (k_scale_hbm, v_scale_hbm, k_scale_buf, v_scale_buf), each page's [B, 1]
    column of head h's scales into the [C, 1] buffers, else None."""
    page_size = k_hbm.shape[1]
    copies = []
    for i in range(pages_per_chunk):
        # Past the sequence's last page, re-read that page: the copy stays valid (finite data) and is masked.
        j = jnp.minimum(first_page + chunk * pages_per_chunk + i, last_page - 1)
        page = page_table_ref[row * pages_per_seq + j]
        dst = pl.ds(i * page_size, page_size)
        copies.append(pltpu.make_async_copy(k_hbm.at[page, :, h, :], k_buf.at[slot, dst, :], sems.at[0, slot]))
        copies.append(pltpu.make_async_copy(v_hbm.at[page, :, h, :], v_buf.at[slot, dst, :], sems.at[1, slot]))
        if scale_refs is not None:
            ks_hbm, vs_hbm, ks_buf, vs_buf = scale_refs
            heads = pl.ds(h, 1)
            copies.append(pltpu.make_async_copy(ks_hbm.at[page, :, heads], ks_buf.at[slot, dst, :], sems.at[0, slot]))
            copies.append(pltpu.make_async_copy(vs_hbm.at[page, :, heads], vs_buf.at[slot, dst, :], sems.at[1, slot]))
    return copies


def _attend_chunk(q, k, v, carry, key_pos0, row_pos, *, scale, soft_cap, sliding_window, attention_chunk):
    """One online-softmax step of the [M, D] query tile against a [C, D] chunk of keys and values."""
    acc, m_prev, l_prev = carry
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_precision(k.dtype),
                        preferred_element_type=jnp.float32) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    key_pos = key_pos0 + lax.broadcasted_iota(jnp.int32, s.shape, 1)
    mask = key_pos <= row_pos
    if sliding_window is not None or attention_chunk is not None:
        mask &= key_pos >= first_visible_key(row_pos, sliding_window, attention_chunk)
    s = jnp.where(mask, s, MASK_VALUE)
    m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    p = jnp.exp(s - m_next)
    correction = jnp.exp(m_prev - m_next)
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=_precision(v.dtype),
                         preferred_element_type=jnp.float32)
    return acc * correction + pv, m_next, l_prev * correction + p.sum(axis=1, keepdims=True)


def _kernel(seq_ref, q_pos_ref, kv_end_ref, page_table_ref,  # scalar prefetch (SMEM)
            q_ref, k_hbm, v_hbm,  # inputs: q tile in VMEM, caches in HBM
            *refs,  # [k/v_scale_hbm] (quantized), [sink_ref] (sinks), o_ref, k_buf, v_buf, sems, [k/v scale bufs]
            scale: float, block_q: int, pages_per_chunk: int, pages_per_seq: int,
            sliding_window: int | None, soft_cap: float | None, compute_dtype: jnp.dtype | None, has_sinks: bool,
            attention_chunk: int | None = None):
    # Quantized pages add their scales in HBM (inputs) and two [2, C, 1] float32 scale buffers (scratch); sinks add
    # the [M, 1] float32 sinks of the tile's rows (a VMEM block, a column like the softmax's running max).
    ks_hbm, vs_hbm, *refs = refs if compute_dtype is not None else (None, None, *refs)
    sink_ref, o_ref, k_buf, v_buf, sems, *scale_bufs = refs if has_sinks else (None, *refs)
    scale_refs = None if compute_dtype is None else (ks_hbm, vs_hbm, *scale_bufs)
    h, b = pl.program_id(0), pl.program_id(1)
    row, q_pos, kv_end = seq_ref[b], q_pos_ref[b], kv_end_ref[b]
    page_size = k_hbm.shape[1]
    # lax.div/rem (truncating) rather than // and %: operands are non-negative, and floor division lowers
    # through sign(), whose Mosaic rule needs to know the TPU generation.
    first_key = first_visible_key(q_pos, sliding_window, attention_chunk)
    first_page = 0 if sliding_window is None and attention_chunk is None else lax.div(first_key, page_size)
    last_page = lax.div(kv_end + page_size - 1, page_size)
    num_chunks = lax.div(last_page - first_page + pages_per_chunk - 1, pages_per_chunk)
    copies = functools.partial(_chunk_copies, k_hbm, v_hbm, k_buf, v_buf, sems, page_table_ref, scale_refs, row=row,
                               h=h,
                               first_page=first_page, last_page=last_page, pages_per_chunk=pages_per_chunk,
                               pages_per_seq=pages_per_seq)
    q = q_ref[...]
    rows, head_dim = q.shape
    chunk_len = k_buf.shape[1]
    # Row r holds token r % block_q of the block (rows are head-major); block_q is a power of two.
    row_pos = q_pos + (lax.broadcasted_iota(jnp.int32, (rows, chunk_len), 0) & (block_q - 1))
    attend = functools.partial(_attend_chunk, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
                               attention_chunk=attention_chunk)

    @pl.when(num_chunks > 0)
    def _():
        for copy in copies(chunk=0, slot=0):
            copy.start()

    def body(c, carry):
        slot = lax.rem(c, 2)

        @pl.when(c + 1 < num_chunks)
        def _():
            for copy in copies(chunk=c + 1, slot=1 - slot):
                copy.start()

        for copy in copies(chunk=c, slot=slot):
            copy.wait()
        key_pos0 = (first_page + c * pages_per_chunk) * page_size
        k, v = k_buf[slot], v_buf[slot]
        if compute_dtype is not None:
            # Dequantize the chunk in VMEM: a [C, 1] column of scales broadcasts along the lanes of each row
            # (scaling the score columns instead would need the scales as a [1, C] row: a transpose).
            ks_buf, vs_buf = scale_bufs
            k = (k.astype(jnp.float32) * ks_buf[slot]).astype(compute_dtype)
            v = (v.astype(jnp.float32) * vs_buf[slot]).astype(compute_dtype)
        return attend(q, k, v, carry, key_pos0, row_pos)

    init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows, 1), MASK_VALUE, jnp.float32),
            jnp.zeros((rows, 1), jnp.float32))
    acc, m, denom = lax.fori_loop(0, num_chunks, body, init)
    if sink_ref is not None:
        weight, sink_term = sink_weights(m, sink_ref[...])
        o_ref[...] = acc * (weight / (denom * weight + sink_term))
    else:
        o_ref[...] = acc / jnp.where(denom == 0, 1.0, denom)  # padding blocks (no keys) write zeros


def ragged_paged_attention_tpu(q: jax.Array, k_pages: jax.Array | QuantizedPages, v_pages: jax.Array | QuantizedPages,
                               page_table: jax.Array,
                               query_start: jax.Array, seq_lens: jax.Array, *, scale: float,
                               sliding_window: int | None = None, soft_cap: float | None = None,
                               sinks: jax.Array | None = None, block_q: int = 16, pages_per_chunk: int = 8,
                               interpret: bool = False, attention_chunk: int | None = None) -> jax.Array:
    """Mosaic kernel with the interface of `ragged_paged_attention` (see pallas_kernels/__init__.py).

    block_q: query tokens per block, a power of two; group * block_q rows should be a multiple of 16 (bf16
    sublane tiling). pages_per_chunk: pages per DMA chunk; the chunk (pages_per_chunk * page_size keys) is the
    N of the QK^T matmul, so 128+ keys keep the MXU busy, and each buffer costs chunk * D * itemsize of VMEM.
    Quantized pages (QuantizedPages, int8 or float8_e4m3fn values) are copied as stored, a chunk's scales beside
    them, and dequantized per chunk in VMEM. sinks (float32 [H]): each query head's attention sink, which joins
    the softmax's denominator at the end.
    """
    assert block_q & (block_q - 1) == 0, "block_q must be a power of two"
    quantized = isinstance(k_pages, QuantizedPages)
    compute_dtype = jnp.dtype(k_pages.dtype) if quantized else None
    scales = (k_pages.scales, v_pages.scales) if quantized else ()
    if quantized:
        k_pages, v_pages = k_pages.values, v_pages.values
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, page_size = k_pages.shape[2], k_pages.shape[1]
    num_seqs, pages_per_seq = page_table.shape
    pages_per_chunk = min(pages_per_chunk, pages_per_seq)
    meta = block_metadata(query_start, seq_lens, num_tokens, block_q)
    q_packed = pack_q(q.astype(k_pages.dtype if compute_dtype is None else compute_dtype), meta, num_kv_heads,
                      block_q, num_heads // num_kv_heads)
    nb, _, rows, _ = q_packed.shape
    # Each KV head's [M, 1] column of its rows' sinks; its block index changes with the head only, so it is copied
    # once per head, not once per block.
    sink_args = () if sinks is None else (pack_sinks(sinks, num_kv_heads, block_q, rows // block_q)[..., None],)
    sink_specs = [pl.BlockSpec((None, rows, 1), lambda h, b, *_: (h, 0, 0))] * len(sink_args)
    tile = pl.BlockSpec((None, None, rows, head_dim), lambda h, b, *_: (b, h, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    chunk_len = pages_per_chunk * page_size
    kernel = functools.partial(_kernel, scale=scale, block_q=block_q, pages_per_chunk=pages_per_chunk,
                               pages_per_seq=pages_per_seq, sliding_window=sliding_window, soft_cap=soft_cap,
                               compute_dtype=compute_dtype, has_sinks=sinks is not None,
                               attention_chunk=attention_chunk)
    scale_scratch = [pltpu.VMEM((2, chunk_len, 1), jnp.float32)] * 2 if quantized else []
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(num_kv_heads, nb),
            in_specs=[tile, hbm, hbm] + [hbm] * len(scales) + sink_specs,
            out_specs=tile,
            scratch_shapes=[pltpu.VMEM((2, chunk_len, head_dim), k_pages.dtype),
                            pltpu.VMEM((2, chunk_len, head_dim), v_pages.dtype),
                            pltpu.SemaphoreType.DMA((2, 2)), *scale_scratch],
        ),
        out_shape=jax.ShapeDtypeStruct((nb, num_kv_heads, rows, head_dim), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="ragged_paged_attention_mosaic",
    )(meta.seq, meta.q_pos, meta.kv_end, page_table.reshape(-1), q_packed, k_pages, v_pages, *scales, *sink_args)
    return unpack_out(out, query_start, num_tokens, num_heads, block_q)
