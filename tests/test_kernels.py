"""The Pallas kernels, run by the Pallas interpreter on CPU, against the pure-JAX reference; and the engine with
attention_backend="pallas-interpret" against "reference".

Interpretation is slow, so the cases below cover the axes (batch kind, GQA ratio, head_dim, page size, dtype,
window/soft-cap) pairwise rather than as a full product; each case is a ragged batch with shuffled pages,
lengths ending mid-page and on page boundaries, padding tokens and padding sequence rows.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import cpu_kernels
from pallas_kernels import (
    ragged_paged_attention,
    ragged_paged_attention_chunked,
    ragged_paged_attention_gpu,
    ragged_paged_attention_ref,
    ragged_paged_attention_tpu,
    resolve_backend,
    token_positions,
    write_kv,
)

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
KERNELS = {"tpu": ragged_paged_attention_tpu, "gpu": ragged_paged_attention_gpu}

# (q_len, kv_len) per sequence. Page sizes are 16 or 32: 16, 32, 64 end on a boundary, the others mid-page.
BATCHES = {
    "decode": [(1, 1), (1, 16), (1, 33), (1, 64), (1, 47), (1, 150)],
    "prefill": [(16, 16), (21, 21), (32, 32), (5, 5)],
    "mixed": [(1, 40), (12, 12), (20, 52), (1, 32), (3, 17), (9, 140)],  # chunks over a cached prefix; decodes
}


def make_batch(rng: np.random.Generator, seqs, *, heads: int, kv_heads: int, head_dim: int, page_size: int,
               dtype, pad_tokens: int = 3, pad_seqs: int = 2):
    """Random q and paged K/V for `seqs`, pages shuffled over the cache; returns kernel args and ref metadata."""
    q_lens = np.array([q for q, _ in seqs], np.int32)
    kv_lens = np.array([kv for _, kv in seqs], np.int32)
    num_seqs, num_tokens = len(seqs) + pad_seqs, int(q_lens.sum()) + pad_tokens
    pages_per_seq = -(-kv_lens // page_size)
    width = int(pages_per_seq.max()) + 1  # one spare column: entries past a sequence's length are never read
    num_pages = int(pages_per_seq.sum()) + 4
    perm = rng.permutation(num_pages)
    page_table = np.zeros((num_seqs, width), np.int32)
    query_start = np.full(num_seqs + 1, q_lens.sum(), np.int32)
    query_start[: len(seqs) + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    seq_lens = np.zeros(num_seqs, np.int32)
    seq_lens[: len(seqs)] = kv_lens
    token_seq, positions = np.zeros(num_tokens, np.int32), np.zeros(num_tokens, np.int32)
    used = 0
    for s, (q_len, kv_len) in enumerate(seqs):
        page_table[s, : pages_per_seq[s]] = perm[used: used + pages_per_seq[s]]
        page_table[s, pages_per_seq[s]:] = perm[-1]
        used += pages_per_seq[s]
        token_seq[query_start[s]: query_start[s + 1]] = s
        positions[query_start[s]: query_start[s + 1]] = np.arange(kv_len - q_len, kv_len)
    cache_shape = (num_pages, page_size, kv_heads, head_dim)
    q = jnp.asarray(rng.standard_normal((num_tokens, heads, head_dim)), dtype)
    k_pages = jnp.asarray(rng.standard_normal(cache_shape), dtype)
    v_pages = jnp.asarray(rng.standard_normal(cache_shape), dtype)
    args = (q, k_pages, v_pages, jnp.asarray(page_table), jnp.asarray(query_start), jnp.asarray(seq_lens))
    return args, (token_seq, positions, int(q_lens.sum()))


def max_error(kernel, args, ref_meta, **kwargs) -> float:
    token_seq, positions, num_real = ref_meta
    q, k_pages, v_pages, page_table, _, _ = args
    ref = ragged_paged_attention_ref(q, k_pages, v_pages, page_table, jnp.asarray(token_seq),
                                     jnp.asarray(positions), **kwargs)
    out = np.asarray(jax.jit(functools.partial(kernel, **kwargs))(*args))  # kwargs are static
    assert out.shape == ref.shape and out.dtype == np.float32
    assert np.all(out[num_real:] == 0), "padding tokens must come out as zeros"
    return float(np.abs(out[:num_real] - np.asarray(ref)[:num_real]).max())


# (batch, heads, kv_heads, head_dim, page_size, dtype, extra kwargs): every GQA ratio (1, 4, 8), head_dim (64,
# 128), page size (16, 32), dtype and batch kind appears, and the window / soft cap are crossed with both; an
# attention chunk that pages do not divide.
CASES = [
    ("decode", 8, 1, 64, 16, jnp.float32, {}),
    ("prefill", 4, 4, 128, 32, jnp.float32, {}),
    ("mixed", 8, 2, 64, 32, jnp.float32, {}),
    ("mixed", 8, 1, 128, 16, jnp.bfloat16, {}),
    ("decode", 4, 4, 128, 32, jnp.bfloat16, {}),
    ("prefill", 8, 2, 64, 16, jnp.bfloat16, {}),
    ("mixed", 4, 1, 64, 16, jnp.float32, {"sliding_window": 9, "soft_cap": 5.0}),
    ("mixed", 6, 2, 64, 16, jnp.bfloat16, {"sliding_window": 16}),  # GQA 3 (not a power of two), as in the bench
    ("mixed", 4, 2, 64, 16, jnp.float32, {"attention_chunk": 24}),  # Llama 4's chunks, across page boundaries
]


@pytest.mark.parametrize("kernel_name", list(KERNELS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-h{c[1]}kv{c[2]}-d{c[3]}-b{c[4]}-"
                         f"{jnp.dtype(c[5]).name}{'-' + '-'.join(c[6]) if c[6] else ''}")
def test_kernel_matches_reference(kernel_name, case):
    batch, heads, kv_heads, head_dim, page_size, dtype, extra = case
    rng = np.random.default_rng(CASES.index(case))
    args, ref_meta = make_batch(rng, BATCHES[batch], heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                page_size=page_size, dtype=dtype)
    kernel = functools.partial(KERNELS[kernel_name], interpret=True)
    err = max_error(kernel, args, ref_meta, scale=head_dim**-0.5, **extra)
    assert err <= TOLERANCE[dtype], f"max abs error {err:.3g}"


def test_tpu_kernel_under_the_tpu_interpreter():
    """The TPU interpreter models DMAs and semaphores: copies land only when waited on, scratch starts as NaN,
    out-of-bounds reads raise, and with detect_races a read of a buffer while a DMA writes it is reported."""
    rng = np.random.default_rng(7)
    args, ref_meta = make_batch(rng, BATCHES["mixed"], heads=4, kv_heads=2, head_dim=64, page_size=16,
                                dtype=jnp.float32)
    params = pltpu.InterpretParams(detect_races=True)
    kernel = functools.partial(ragged_paged_attention_tpu, interpret=params, pages_per_chunk=2)
    assert max_error(kernel, args, ref_meta, scale=0.125) <= 1e-5
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call  # private: where jax 0.10 keeps race state

    assert interpret_pallas_call.races is not None and not interpret_pallas_call.races.races_found


def test_kernels_agree_for_every_block_and_chunk_size():
    """Small query blocks split prefills over several blocks; small chunks make the double-buffer loop run long."""
    rng = np.random.default_rng(3)
    args, ref_meta = make_batch(rng, BATCHES["mixed"], heads=4, kv_heads=2, head_dim=64, page_size=16,
                                dtype=jnp.float32)
    tpu = functools.partial(ragged_paged_attention_tpu, interpret=True, block_q=4, pages_per_chunk=1)
    gpu = functools.partial(ragged_paged_attention_gpu, interpret=True, block_q=8, pages_per_step=1)
    for kernel in (tpu, gpu):
        assert max_error(kernel, args, ref_meta, scale=0.125) <= 1e-5


@pytest.mark.parametrize("pages_per_chunk", [1, 3, 8])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-h{c[1]}kv{c[2]}-d{c[3]}-b{c[4]}-"
                         f"{jnp.dtype(c[5]).name}{'-' + '-'.join(c[6]) if c[6] else ''}")
def test_chunked_pure_jax_attention_matches_the_definition(case, pages_per_chunk):
    """The engine's pure-JAX attention walks the page table a chunk at a time with an online softmax, as far as the
    furthest position: 3 pages do not divide the table (padded columns), 1 page makes the longest loop."""
    batch, heads, kv_heads, head_dim, page_size, dtype, extra = case
    rng = np.random.default_rng(100 + CASES.index(case))
    args, (token_seq, positions, num_real) = make_batch(rng, BATCHES[batch], heads=heads, kv_heads=kv_heads,
                                                        head_dim=head_dim, page_size=page_size, dtype=dtype)
    q, k_pages, v_pages, page_table, _, _ = args
    meta = (jnp.asarray(token_seq), jnp.asarray(positions))
    ref = np.asarray(ragged_paged_attention_ref(q, k_pages, v_pages, page_table, *meta, scale=0.1, **extra))
    chunked = jax.jit(functools.partial(ragged_paged_attention_chunked, scale=0.1, pages_per_chunk=pages_per_chunk,
                                        **extra))
    out = np.asarray(chunked(q, k_pages, v_pages, page_table, *meta))
    assert np.abs(out[:num_real] - ref[:num_real]).max() <= TOLERANCE[dtype]


def eager_sink_attention(args, ref_meta, sinks, *, scale, sliding_window=None) -> np.ndarray:
    """transformers' eager gpt-oss attention in numpy, token by token: the head's sink is one more logit column,
    softmaxed with the scores and then dropped. Real tokens only."""
    q, k_pages, v_pages, page_table = (np.asarray(a, np.float64) for a in args[:4])
    token_seq, positions, num_real = ref_meta
    heads, kv_heads, page_size = q.shape[1], k_pages.shape[2], k_pages.shape[1]
    out = np.zeros((num_real, heads, q.shape[2]))
    for t in range(num_real):
        pos = np.arange(positions[t] + 1)
        if sliding_window is not None:
            pos = pos[pos > positions[t] - sliding_window]
        pages = page_table[token_seq[t], pos // page_size].astype(int)
        for h in range(heads):
            kv = h // (heads // kv_heads)
            k, v = k_pages[pages, pos % page_size, kv], v_pages[pages, pos % page_size, kv]
            logits = np.append(k @ q[t, h] * scale, sinks[h])
            probs = np.exp(logits - logits.max())
            out[t, h] = (probs / probs.sum())[:-1] @ v
    return out


def test_reference_sinks_are_the_eager_formula():
    """gpt-oss's attention sinks in the reference against the eager formula, and the chunked attention (walking 1 or
    3 pages a step: the sink joins once, at the end) against the reference; realistic sinks change the result."""
    rng = np.random.default_rng(21)
    args, ref_meta = make_batch(rng, BATCHES["mixed"], heads=6, kv_heads=2, head_dim=16, page_size=16,
                                dtype=jnp.float32)
    sinks = jnp.asarray(rng.normal(size=6) * 2, jnp.float32)
    q, k_pages, v_pages, page_table, _, _ = args
    token_seq, positions, num_real = ref_meta
    meta = (jnp.asarray(token_seq), jnp.asarray(positions))
    for extra in ({}, {"sliding_window": 9}):
        ref = np.asarray(ragged_paged_attention_ref(q, k_pages, v_pages, page_table, *meta, scale=0.25, sinks=sinks,
                                                    **extra))[:num_real]
        np.testing.assert_allclose(ref, eager_sink_attention(args, ref_meta, np.asarray(sinks), scale=0.25, **extra),
                                   atol=1e-5, rtol=0)
        without = np.asarray(ragged_paged_attention_ref(q, k_pages, v_pages, page_table, *meta, scale=0.25, **extra))
        assert np.abs(without[:num_real] - ref).max() > 0.1, "the sinks must change the result"
        for pages_per_chunk in (1, 3):
            chunked = jax.jit(functools.partial(ragged_paged_attention_chunked, scale=0.25,
                                                pages_per_chunk=pages_per_chunk, **extra))
            out = np.asarray(chunked(q, k_pages, v_pages, page_table, *meta, sinks=sinks))
            np.testing.assert_allclose(out[:num_real], ref, atol=1e-5, rtol=0)


# (batch, heads, kv_heads, head_dim, page_size, dtype, extra kwargs) with sinks: a decode batch in float32 (GQA 4)
# and a windowed mixed one in bfloat16 (GQA 3: the Triton kernel pads the group, whose rows' sinks are dropped).
SINK_CASES = [
    ("decode", 8, 2, 64, 16, jnp.float32, {}),
    ("mixed", 6, 2, 64, 16, jnp.bfloat16, {"sliding_window": 16}),
]


def sink_error(kernel, args, ref_meta, sinks, **kwargs) -> float:
    """max_error with sinks given as a traced argument (as the engine's jitted step gives them), after checking that
    the sinks move the reference's output well beyond the tolerance (dropped or doubled sinks cannot pass)."""
    token_seq, positions, num_real = ref_meta
    meta = (jnp.asarray(token_seq), jnp.asarray(positions))
    with_sinks, without = (np.asarray(ragged_paged_attention_ref(*args[:4], *meta, sinks=s, **kwargs))[:num_real]
                           for s in (sinks, None))
    assert np.abs(with_sinks - without).max() > 0.1
    out = np.asarray(jax.jit(lambda sinks, *args: kernel(*args, sinks=sinks, **kwargs))(sinks, *args))
    assert np.all(out[num_real:] == 0), "padding tokens must come out as zeros"
    return float(np.abs(out[:num_real] - with_sinks).max())


@pytest.mark.parametrize("kernel_name", list(KERNELS))
@pytest.mark.parametrize("case", SINK_CASES, ids=lambda c: f"{c[0]}-h{c[1]}kv{c[2]}-{jnp.dtype(c[5]).name}")
def test_kernel_with_sinks_matches_reference(kernel_name, case):
    batch, heads, kv_heads, head_dim, page_size, dtype, extra = case
    rng = np.random.default_rng(40 + SINK_CASES.index(case))
    args, ref_meta = make_batch(rng, BATCHES[batch], heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                page_size=page_size, dtype=dtype)
    sinks = jnp.asarray(rng.normal(size=heads) * 2, jnp.float32)
    # One split: the Triton kernel normalizes in the kernel (its splits' merge is test_gpu_kernel_split_over_keys's).
    options = {"kv_splits": 1} if kernel_name == "gpu" else {}
    kernel = functools.partial(KERNELS[kernel_name], interpret=True, **options)
    err = sink_error(kernel, args, ref_meta, sinks, scale=head_dim**-0.5, **extra)
    assert err <= TOLERANCE[dtype], f"max abs error {err:.3g}"


@pytest.mark.parametrize("kv_splits", [2, 3, 16])
def test_gpu_kernel_split_over_keys(kv_splits):
    """Flash decoding: each (block, KV head) split over runs of its keys, partials merged after the kernel. More
    splits than a short sequence has steps leaves empty partials, which must weigh nothing; a window leaves
    fully masked ones. Sinks join at the merge, once per row whatever the splits."""
    rng = np.random.default_rng(11 + kv_splits)
    if kv_splits == 3:
        args, ref_meta = make_batch(rng, BATCHES["mixed"], heads=8, kv_heads=2, head_dim=64, page_size=16,
                                    dtype=jnp.float32)
        kernel = functools.partial(ragged_paged_attention_gpu, interpret=True, kv_splits=3, pages_per_step=1)
        sinks = jnp.asarray(rng.normal(size=8) * 2, jnp.float32)
        assert sink_error(kernel, args, ref_meta, sinks, scale=0.125, sliding_window=9) <= 1e-5
    for batch, extra in (("decode", {}), ("mixed", {"sliding_window": 9})):
        args, ref_meta = make_batch(rng, BATCHES[batch], heads=8, kv_heads=2, head_dim=64, page_size=16,
                                    dtype=jnp.float32)
        kernel = functools.partial(ragged_paged_attention_gpu, interpret=True, kv_splits=kv_splits, pages_per_step=1)
        assert max_error(kernel, args, ref_meta, scale=0.125, **extra) <= 1e-5


# The Triton kernel runs a head_dim that is not a power of two as power-of-two chunks: Phi-3's 96 = 64 + 32 (GQA 4,
# window, soft cap), 48 = 32 + 16 (int8 pages, sinks merged from 3 key splits) and 112 = 64 + 32 + 16 under one KV
# head of 16 query heads (latent attention's shape, sinks normalized in the kernel).
@pytest.mark.parametrize(("batch", "heads", "kv_heads", "head_dim", "dtype", "kv_splits", "sinks", "extra"), [
    ("mixed", 8, 2, 96, jnp.float32, 1, False, {"sliding_window": 9, "soft_cap": 5.0}),
    ("decode", 4, 2, 48, jnp.bfloat16, 3, True, {"int8": True}),
    ("mixed", 16, 1, 112, jnp.bfloat16, 1, True, {})])
def test_gpu_kernel_on_head_dims_that_are_not_powers_of_two(batch, heads, kv_heads, head_dim, dtype, kv_splits, sinks,
                                                            extra):
    from pallas_kernels.quantized import QuantizedPages, quantize_rows

    rng = np.random.default_rng(head_dim)
    args, ref_meta = make_batch(rng, BATCHES[batch][:3], heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                page_size=16, dtype=dtype, pad_seqs=1)
    if extra.get("int8"):
        args = (args[0], *(QuantizedPages(*quantize_rows(x, jnp.int8, jnp.int8), jnp.dtype(dtype).name)
                           for x in args[1:3]), *args[3:])
    kernel = functools.partial(ragged_paged_attention_gpu, interpret=True, kv_splits=kv_splits, pages_per_step=2)
    kwargs = dict(scale=head_dim**-0.5, **{k: v for k, v in extra.items() if k != "int8"})
    err = sink_error(kernel, args, ref_meta, jnp.asarray(rng.normal(size=heads) * 2, jnp.float32), **kwargs) \
        if sinks else max_error(kernel, args, ref_meta, **kwargs)
    assert err <= TOLERANCE[dtype], f"max abs error {err:.3g}"


def test_gpu_kernel_refuses_a_head_dim_chunk_narrower_than_a_dot():
    """72 = 64 + 8: an 8-wide chunk cannot be a tl.dot operand (K >= 16), so the trace fails with a clear error."""
    q, cache = jax.ShapeDtypeStruct((8, 4, 72), jnp.bfloat16), jax.ShapeDtypeStruct((4, 16, 1, 72), jnp.bfloat16)
    meta = [jax.ShapeDtypeStruct(shape, jnp.int32) for shape in ((2, 2), (3,), (2,))]
    with pytest.raises(ValueError, match=r"head_dim 72 = 64 \+ 8.*narrower than 16"):
        jax.eval_shape(functools.partial(ragged_paged_attention_gpu, scale=0.1), q, cache, cache, *meta)


def test_pallas_backend_takes_the_reference_on_gpus_for_a_head_dim_triton_cannot_tile():
    """The engine's "pallas" backend with head_dim 72 still lowers for both platforms: the Mosaic kernel for tpu,
    the reference attention for cuda (no Triton call), instead of failing the trace of every platform's branch."""
    from tools.check_lowering import CUSTOM_CALL, Shape, lower
    shape = Shape("d72", 8, 2, 72, "bfloat16", 16, 64, 8)
    assert CUSTOM_CALL["tpu"] in lower("tpu", shape, 8, 8, 4)
    assert CUSTOM_CALL["cuda"] not in lower("cuda", shape, 8, 8, 4)
    assert CUSTOM_CALL["cuda"] in lower("cuda", Shape("d80", 8, 2, 80, "bfloat16", 16, 64, 8), 8, 8, 4)


def test_empty_batch_is_all_padding():
    """A warm-up batch: no real tokens, every sequence row empty. Kernels must run and return zeros."""
    q = jnp.ones((8, 4, 64), jnp.float32)
    cache = jnp.ones((4, 16, 2, 64), jnp.float32)
    meta = (jnp.zeros((4, 2), jnp.int32), jnp.zeros(5, jnp.int32), jnp.zeros(4, jnp.int32))
    for backend in ("reference", "pallas-interpret-tpu", "pallas-interpret-gpu"):
        out = ragged_paged_attention(q, cache, cache, *meta, scale=0.125, backend=backend)
        assert out.shape == q.shape and np.isfinite(np.asarray(out)).all()
    for backend in ("pallas-interpret-tpu", "pallas-interpret-gpu"):  # a sink, no keys: zeros, not NaNs
        out = ragged_paged_attention(q, cache, cache, *meta, scale=0.125, sinks=jnp.full(4, 3.0), backend=backend)
        assert np.all(np.asarray(out) == 0)


def test_token_positions_match_the_runner_convention():
    rng = np.random.default_rng(1)
    _, (token_seq, positions, num_real) = make_batch(rng, BATCHES["mixed"], heads=1, kv_heads=1, head_dim=8,
                                                      page_size=16, dtype=jnp.float32)
    args, _ = make_batch(np.random.default_rng(1), BATCHES["mixed"], heads=1, kv_heads=1, head_dim=8,
                         page_size=16, dtype=jnp.float32)
    seq, pos = token_positions(args[4], args[5], len(token_seq))
    np.testing.assert_array_equal(np.asarray(seq), token_seq)
    np.testing.assert_array_equal(np.asarray(pos), positions)


def test_row_of_is_numpys_right_sided_search():
    """The blocks' and tokens' sequence search (an unrolled binary search) against numpy's searchsorted, on sorted
    ends with repeats (empty sequences, padding rows) at sizes on and off powers of two."""
    from pallas_kernels.blocks import row_of

    rng = np.random.default_rng(0)
    for size in (1, 2, 3, 7, 8, 9, 32, 33, 257):
        ends = np.sort(rng.integers(0, 40, size)).astype(np.int32)
        items = np.arange(-2, 45, dtype=np.int32)
        np.testing.assert_array_equal(np.asarray(row_of(jnp.asarray(ends), jnp.asarray(items))),
                                      np.searchsorted(ends, items, side="right"))


def test_write_kv_drops_padding_slots():
    cache = jnp.zeros((2, 4, 1, 2), jnp.float32)
    k = jnp.arange(6, dtype=jnp.float32).reshape(3, 1, 2) + 1
    k_pages, _ = write_kv(cache, cache, k, k, jnp.asarray([5, 0, 8], jnp.int32))  # slot 8 == N * B: padding
    flat = np.asarray(k_pages).reshape(8, 2)
    np.testing.assert_array_equal(flat[5], [1, 2])
    np.testing.assert_array_equal(flat[0], [3, 4])
    assert np.count_nonzero(flat) == 4


def test_resolve_backend():
    assert resolve_backend("auto", "cpu") == ("cpu" if cpu_kernels.available() else "reference")
    assert resolve_backend("auto", "tpu") == resolve_backend("auto", "gpu") == "pallas"
    assert resolve_backend("pallas-interpret", "cpu") == "pallas-interpret"
    with pytest.raises(ValueError, match="TPU or GPU"):
        resolve_backend("pallas", "cpu")
    with pytest.raises(ValueError):
        resolve_backend("flash", "cpu")
    with pytest.raises(NotImplementedError, match="platform cpu"):  # called directly: no CPU kernel to lower
        ragged_paged_attention(jnp.ones((8, 1, 8)), jnp.ones((1, 16, 1, 8)), jnp.ones((1, 16, 1, 8)),
                               jnp.zeros((1, 1), jnp.int32), jnp.zeros(2, jnp.int32), jnp.zeros(1, jnp.int32),
                               scale=1.0, backend="pallas")


def test_engine_config_accepts_the_backends():
    from jserve.config import EngineConfig

    for backend in ("auto", "reference", "cpu", "pallas", "pallas-interpret", "pallas-interpret-gpu"):
        assert EngineConfig(attention_backend=backend).attention_backend == backend
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="triton")


def _mixed_workload(llm, prompts, params):
    """A first request fills the prefix cache; then a batch reuses it (cache hits) while chunking long prompts."""
    first = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    return first + rest


def test_engine_pallas_interpret_matches_reference(hf_model_dir, llm_factory):
    from jserve.sampling_params import SamplingParams

    rng = np.random.default_rng(0)
    prefix = rng.integers(3, 500, 40).tolist()
    prompts = [prefix + rng.integers(3, 500, 7).tolist(), prefix + rng.integers(3, 500, 30).tolist(),
               rng.integers(3, 500, 5).tolist(), prefix[:33]]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    model_dir = hf_model_dir("llama")
    # 24 tokens per step: the 70-token prompt is prefilled in chunks, alongside other requests' decodes.
    settings = dict(max_num_batched_tokens=24, max_model_len=128)
    results = {}
    kernels = ("pallas-interpret", "pallas-interpret-gpu")
    for backend in ("reference", *kernels):
        llm = llm_factory(model_dir, attention_backend=backend, **settings)
        results[backend] = _mixed_workload(llm, prompts, params)
        # The Triton kernel (the GPU's configuration) and the pure-JAX attention read only the pages their sequences
        # reach, so one full-width page table serves every step and decodes run in bursts; the TPU kernel, not yet
        # measured for it, buckets the width.
        executor = llm.engine.executor
        assert (len(executor.page_buckets) == 1) == executor.supports_burst == (backend != "pallas-interpret")
    for backend in kernels:
        assert sum(out.num_cached_tokens for out in results[backend][1:]) >= 64  # prefix-cache hits
        for ref, got in zip(results["reference"], results[backend], strict=True):
            assert got.outputs[0].token_ids == ref.outputs[0].token_ids


@pytest.mark.parametrize(("variant", "backend", "dtype", "atol"), [
    ("mistral", "pallas-interpret-tpu", "float32", 1e-4), ("mistral", "pallas-interpret-gpu", "float32", 1e-4),
    ("mistral", "pallas-interpret-tpu", "bfloat16", 2e-2), ("mistral", "cpu", "float32", 1e-4),
    ("mistral", "cpu", "bfloat16", 5e-2), ("deepseek_v3", "pallas-interpret-gpu", "float32", 1e-4),
    ("deepseek_v3", "pallas-interpret-tpu", "float32", 1e-4)])
def test_model_step_logits_match_reference(hf_model_dir, variant, backend, dtype, atol):
    """One mixed step through the whole model (mistral: GQA 2 + sliding window; deepseek_v3: latent attention, one
    KV head of 48 = 32 + 16, which the Triton kernel runs as two chunks) with each kernel; in bfloat16 the CPU cache
    holds uint16 bits (reference.kv_storage_dtype), which the kernels must read as bfloat16."""
    from jserve.engine.sequence import ScheduledSeq, Sequence
    from jserve.executors import CpuLayerExecutor, XlaExecutor
    from jserve.sampling_params import SamplingParams

    def step_logits(attention_backend: str) -> np.ndarray:
        executor = CpuLayerExecutor if attention_backend == "cpu" else XlaExecutor
        model = executor.load(hf_model_dir(variant), dtype=dtype, attention_backend=attention_backend)
        runner = executor(model, dtype=dtype, num_blocks=16, block_size=16, max_num_batched_tokens=64,
                          max_num_seqs=4, max_model_len=128)
        chunks = []
        for i, n in enumerate((29, 1, 17)):
            seq = Sequence(f"r{i}", list(range(3 + i, 3 + i + n)), SamplingParams())
            seq.block_table = [15 - 2 * i, 4 + i]  # shuffled pages
            chunks.append(ScheduledSeq(seq, n, True))
        return np.asarray(runner.run(runner.prepare(chunks)))[:3]

    np.testing.assert_allclose(step_logits(backend), step_logits("reference"), atol=atol, rtol=0)


@pytest.mark.parametrize(("dtype", "atol"), [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_long_decode_through_the_layer_kernel_matches_reference(hf_model_dir, dtype, atol):
    """A decode over 300 tokens of context (19 pages: the CPU layer kernel splits it into parts and merges them)
    after a 299-token prefill, against the reference backend's logits."""
    from jserve.engine.sequence import ScheduledSeq, Sequence
    from jserve.executors import CpuLayerExecutor, XlaExecutor
    from jserve.sampling_params import SamplingParams

    def decode_logits(attention_backend: str) -> np.ndarray:
        executor = CpuLayerExecutor if attention_backend == "cpu" else XlaExecutor
        model = executor.load(hf_model_dir("llama"), dtype=dtype, attention_backend=attention_backend)
        runner = executor(model, dtype=dtype, num_blocks=24, block_size=16, max_num_batched_tokens=512,
                          max_num_seqs=2, max_model_len=512)
        seq = Sequence("long", [3 + (7 * i) % 380 for i in range(300)], SamplingParams())
        seq.block_table = list(range(23, 4, -1))  # 19 pages, in reverse order
        runner.run(runner.prepare([ScheduledSeq(seq, 299, False)]))
        seq.num_computed_tokens = 299
        return np.asarray(runner.run(runner.prepare([ScheduledSeq(seq, 1, True)])))[:1]

    np.testing.assert_allclose(decode_logits("cpu"), decode_logits("reference"), atol=atol, rtol=0)


def test_stacked_cache_and_weights_give_the_per_layer_results(hf_model_dir):
    """The CPU layer executor keeps K and V as one [L, ...] array each and takes the loader's stacked layer weights
    (~14 arrays to dispatch, not ~14 a layer). A prefill and then a decode give the logits and cache contents of
    per-layer weights and caches through the layer kernel (either form of each), and the logits and cache of the XLA
    executor. So do the matrices laid out in per-thread parts (the loader's default): one part a kernel thread (each
    thread reads its own) and three (shared out block by block)."""
    import dataclasses

    from jserve.engine.sequence import ScheduledSeq, Sequence
    from jserve.executors import CpuLayerExecutor, XlaExecutor
    from jserve.models.batch import KVCache
    from jserve.sampling_params import SamplingParams

    load = functools.partial(CpuLayerExecutor.load, hf_model_dir("llama"), dtype="float32")
    model = load(weight_parts=0)
    assert model.layer_stack is not None
    settings = dict(dtype="float32", num_blocks=12, block_size=16, max_num_batched_tokens=64, max_num_seqs=2,
                    max_model_len=128)

    def prefill_and_decode(stacked_cache: bool, stacked_weights: bool, model=model,
                           executor=CpuLayerExecutor) -> tuple[np.ndarray, ...]:
        loaded = model if stacked_weights or executor is XlaExecutor else dataclasses.replace(model, layer_stack=None)
        runner = executor(loaded, **settings)
        assert runner.kv_cache.stacked == (executor is CpuLayerExecutor)
        assert (getattr(runner, "layer_stack", None) is not None) == stacked_weights
        cache = runner.kv_cache
        if stacked_cache != cache.stacked:
            runner.kv_cache = KVCache(k=jnp.stack(cache.k), v=jnp.stack(cache.v)) if stacked_cache else \
                KVCache(k=list(cache.k), v=list(cache.v))
        seqs = [Sequence(f"r{i}", [3 + (5 * j + i) % 380 for j in range(n)], SamplingParams())
                for i, n in enumerate((40, 9))]
        seqs[0].block_table, seqs[1].block_table = [9, 2, 11], [5]
        runner.run(runner.prepare([ScheduledSeq(s, s.num_tokens - 1, False) for s in seqs]))
        for s in seqs:
            s.num_computed_tokens = s.num_tokens - 1
        logits = np.asarray(runner.run(runner.prepare([ScheduledSeq(s, 1, True) for s in seqs])))[:2]
        assert runner.kv_cache.stacked == stacked_cache
        k, v = runner.kv_cache.k, runner.kv_cache.v
        return logits, np.asarray(k) if stacked_cache else np.stack(k), np.asarray(v) if stacked_cache else np.stack(v)

    per_layer = prefill_and_decode(False, False)
    assert np.abs(per_layer[1]).max() > 0  # the steps wrote K/V
    xla = prefill_and_decode(False, False, XlaExecutor.load(hf_model_dir("llama"), dtype="float32",
                                                            attention_backend="reference"), XlaExecutor)
    for stacked_cache, stacked_weights in [(True, True), (True, False), (False, True)]:
        for got, want in zip(prefill_and_decode(stacked_cache, stacked_weights), per_layer, strict=True):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    for got, want in zip(xla, per_layer, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    if not cpu_kernels.packs_weights("float32"):
        return
    for parts in (None, 3):
        in_parts = load(weight_parts=parts)
        assert in_parts.layer_stack.qkv is None
        assert in_parts.layer_stack.matrix_parts.shape[0] == (parts or cpu_kernels.kernel_threads())
        for got, want in zip(prefill_and_decode(True, True, in_parts), per_layer, strict=True):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="per-thread parts"):  # its layers' own matrices are placeholders
        prefill_and_decode(True, False, in_parts)


def test_layer_kernel_rejects_weight_parts_that_disagree_with_the_layer(hf_model_dir):
    """Per-thread parts of the wrong size, or without the intermediate size they are laid out by, are refused with a
    clear error (not read out of bounds)."""
    from jserve.executors import CpuLayerExecutor
    from jserve.models.layers import rope_inv_freq

    if not cpu_kernels.packs_weights("float32"):
        pytest.skip("the CPU kernels do not pack weights here")
    model = CpuLayerExecutor.load(hf_model_dir("llama"), dtype="float32", weight_parts=2)
    cfg, stack = model.config, model.layer_stack

    def call(weights, **kwargs):
        pages = (cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim)
        x, _, _ = cpu_kernels.decoder_layers(
            jnp.ones((1, cfg.hidden_size)), weights, jnp.zeros(pages), jnp.zeros(pages), positions=jnp.array([0]),
            slot_mapping=jnp.array([0]), page_table=jnp.array([[0, 1]]), query_start=jnp.array([0, 1]),
            seq_lens=jnp.array([1]), inv_freq=rope_inv_freq(cfg), num_heads=cfg.num_heads, eps=cfg.rms_norm_eps,
            scale=cfg.head_dim**-0.5, **kwargs)
        return np.asarray(x)

    assert np.isfinite(call(stack, intermediate_size=cfg.intermediate_size)).all()
    short = stack._replace(matrix_parts=stack.matrix_parts[:, :, :-32])
    with pytest.raises(Exception, match="per-thread parts disagree"):
        call(short, intermediate_size=cfg.intermediate_size)
    with pytest.raises(Exception, match="per-thread parts disagree"):
        call(stack, intermediate_size=cfg.intermediate_size + 32)
    with pytest.raises(ValueError, match="intermediate_size"):
        call(stack)


def test_the_phase_profile_times_each_step_of_a_layer_kernel_call(hf_model_dir):
    """With the profile on, one batch-1 decode call of the layer kernel is counted once, within the time the caller
    saw it take, with time running each step of a layer; with it off, nothing is counted."""
    from jserve.executors import CpuLayerExecutor
    from jserve.models.layers import rope_inv_freq

    model = CpuLayerExecutor.load(hf_model_dir("llama"), dtype="float32")
    cfg = model.config
    pages = (cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim)

    def decode() -> float:
        start = time.perf_counter()
        x, _, _ = cpu_kernels.decoder_layers(
            jnp.ones((1, cfg.hidden_size)), model.layer_stack, jnp.zeros(pages), jnp.zeros(pages),
            positions=jnp.array([3]), slot_mapping=jnp.array([3]), page_table=jnp.array([[0, 1]]),
            query_start=jnp.array([0, 1]), seq_lens=jnp.array([4]), inv_freq=rope_inv_freq(cfg),
            num_heads=cfg.num_heads, eps=cfg.rms_norm_eps, scale=cfg.head_dim**-0.5,
            intermediate_size=cfg.intermediate_size)
        assert np.isfinite(np.asarray(x)).all()
        return time.perf_counter() - start

    decode()
    cpu_kernels.profile_phases(True)
    try:
        wall = decode()
        profile = cpu_kernels.phase_profile()
    finally:
        cpu_kernels.profile_phases(False)
    layers = profile.calls["decoder_layers"]
    assert layers.count == 1 and 0 < layers.seconds <= wall
    assert 0 < layers.before_phases_s and 0 < layers.after_phases_s
    assert layers.before_phases_s + layers.after_phases_s < layers.seconds
    assert profile.calls["matmul"].count == 0
    running = dict(zip(cpu_kernels.PHASE_KINDS, profile.busy_s.sum(axis=0), strict=True))
    assert all(running[kind] > 0 for kind in ("qkv", "rotary", "attention", "o", "gate_up", "down")), running
    in_phases = profile.busy_s[0].sum() + profile.wait_s[0].sum()  # the caller's, inside its call
    assert 0 < in_phases <= layers.seconds - layers.before_phases_s - layers.after_phases_s + 1e-6
    decode()
    assert cpu_kernels.phase_profile().calls["decoder_layers"].count == 0


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_a_step_traces_and_lowers_the_kernel_once_not_once_per_layer(platform, hf_model_dir, monkeypatch):
    """The layers' attention calls share one trace and one lowered function per step shape: the kernel is traced
    once and its custom call appears once in the lowered step, however many layers call it."""
    import sys
    from pathlib import Path

    from pallas_kernels import interface

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/ and tools/ run from the checkout
    from benchmarks.trace_lower import abstract_executor
    from jserve.engine.packing import pack
    from tools.check_lowering import CUSTOM_CALL

    layers = 3
    # A page-table width of each platform's own, so that neither case finds the other's trace in jit's cache.
    max_model_len = {"cuda": 256, "tpu": 512}[platform]
    executor = abstract_executor(hf_model_dir("llama", num_hidden_layers=layers), "bfloat16", max_model_len)
    kernel = {"cuda": "ragged_paged_attention_gpu", "tpu": "ragged_paged_attention_tpu"}[platform]
    traced = []
    original = getattr(interface, kernel)
    monkeypatch.setattr(interface, kernel, lambda *a, **k: traced.append(1) or original(*a, **k))

    def lowered_text() -> str:
        traced.clear()
        packed, layout = pack(max(executor.warmup_batches(), key=lambda b: b.page_table.shape[1]))
        step = jax.jit(executor._packed_forward, static_argnums=(3,))
        return step.trace(executor.params, executor.kv_cache, packed, layout).lower(
            lowering_platforms=(platform,)).as_text()

    assert lowered_text().count(CUSTOM_CALL[platform]) == 1 and len(traced) == 1
    monkeypatch.setattr(interface, "_attention", interface._attention.__wrapped__)  # the per-layer trace it avoids
    assert lowered_text().count(CUSTOM_CALL[platform]) == layers and len(traced) == layers


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_check_lowering_passes(platform):
    """The CI gate itself: every kernel exports for its platform at the 8B and benchmark shapes and at head dims that
    are not powers of two (~6 s each)."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent  # tools/ is not installed: it runs from the checkout
    result = subprocess.run([sys.executable, "-m", "tools.check_lowering", "--platform", platform],
                            capture_output=True, text=True, timeout=300, cwd=repo)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 failure(s)" in result.stdout and result.stdout.count("ok   ") >= 24


def test_chunked_attention_sees_only_its_own_chunk():
    """The definition's attention_chunk, against a dense causal softmax over each query's own chunk of keys."""
    rng = np.random.default_rng(31)
    args, (token_seq, positions, num_real) = make_batch(rng, BATCHES["mixed"], heads=4, kv_heads=2, head_dim=32,
                                                        page_size=16, dtype=jnp.float32)
    q, k_pages, v_pages, page_table, _, _ = args
    out = np.asarray(ragged_paged_attention_ref(q, k_pages, v_pages, page_table, jnp.asarray(token_seq),
                                                jnp.asarray(positions), scale=0.2, attention_chunk=24))
    k_all, v_all = np.asarray(k_pages), np.asarray(v_pages)
    for t in range(num_real):
        pos = int(positions[t])
        keys = np.arange(pos // 24 * 24, pos + 1)
        pages = np.asarray(page_table)[token_seq[t]][keys // 16]
        k, v = k_all[pages, keys % 16], v_all[pages, keys % 16]  # [L, Hkv, D]
        for h in range(4):
            scores = k[:, h // 2] @ np.asarray(q)[t, h] * 0.2
            weights = np.exp(scores - scores.max())
            np.testing.assert_allclose(out[t, h], weights @ v[:, h // 2] / weights.sum(), atol=1e-5)
