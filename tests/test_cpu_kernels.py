"""cpu_kernels (C++ through XLA's FFI) against references outside them: the matmul against NumPy in float64,
paged attention against the pure-JAX reference on the ragged batches the Pallas kernels are tested with, and the
fallback when the kernels cannot be built."""

from __future__ import annotations

import concurrent.futures
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kernels import BATCHES, CASES, make_batch, max_error

import cpu_kernels
from pallas_kernels import ragged_paged_attention, resolve_backend
from pallas_kernels.reference import ragged_paged_attention_ref

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason=f"{cpu_kernels.unavailable_reason()}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(("rows", "in_features", "out_features"),
                         [(1, 576, 960), (2, 64, 4), (3, 33, 7), (8, 576, 3072), (9, 70, 33), (11, 576, 50),
                          (13, 1536, 576), (25, 100, 17), (32, 96, 40), (64, 40, 129), (300, 576, 200)])
def test_matmul_matches_numpy(rows, in_features, out_features, dtype):
    """Row counts on both paths and around their tiles (the panel path's 1-6 row tiles: 9, 11, 13, 25, 32 rows),
    widths off the 8-lane vectors and the 4- and 16-row weight tiles."""
    rng = np.random.default_rng(rows * 1000 + out_features)
    x = rng.standard_normal((rows, in_features)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((out_features, in_features)), dtype)
    # The stored weights, and x as the kernel takes it: rounded to bfloat16 for bfloat16 weights (as XLA's dot of
    # x.astype(bfloat16) does), then products accumulated in float32.
    x_in = np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32), np.float64)
    expected = x_in @ np.asarray(w.astype(jnp.float32), np.float64).T
    got = np.asarray(jax.jit(cpu_kernels.matmul)(jnp.asarray(x), w))
    assert got.dtype == np.float32 and got.shape == (rows, out_features)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.sqrt(in_features))


def _skip_unless_packed(dtype) -> None:
    if not cpu_kernels.packs_weights(dtype):
        pytest.skip(f"{jnp.dtype(dtype).name} weights are not packed on this CPU (cpu_kernels.packs_weights)")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(("rows", "in_features", "out_features"),
                         [(1, 576, 960), (1, 130, 70), (2, 64, 4), (3, 34, 7), (5, 576, 33), (9, 1536, 576),
                          (12, 100, 64), (13, 576, 3072), (32, 576, 100), (300, 200, 129),
                          (2, 64, 1181), (4, 576, 4000), (7, 130, 70), (8, 576, 96)])
def test_packed_matmul_matches_numpy(rows, in_features, out_features, dtype):
    """Weights packed at load time: every tile height (AVX-512: 1, 2, 4, 8, 12 rows; AVX2: wide tiles of 1-2 rows,
    panel tiles of 1-6, bfloat16 pair tiles up to 8 rows and widened panels past them) and their tails, widths off
    the 32-row pairs of panels, and for bfloat16 inputs rounded to bfloat16 as for plain bfloat16 weights."""
    _skip_unless_packed(dtype)
    rng = np.random.default_rng(rows * 7 + out_features)
    x = rng.standard_normal((rows, in_features)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((out_features, in_features)), dtype)
    packed = cpu_kernels.pack_weight(np.asarray(w))
    width = in_features // 2 if dtype == jnp.bfloat16 else in_features
    assert packed.shape == (-(-out_features // 32), width, 32)
    x_in = np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32), np.float64)
    expected = x_in @ np.asarray(w.astype(jnp.float32), np.float64).T
    got = np.asarray(jax.jit(cpu_kernels.matmul, static_argnums=2)(jnp.asarray(x), jnp.asarray(packed), out_features))
    assert got.shape == (rows, out_features)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.sqrt(in_features))
    with pytest.raises(ValueError, match="out_features"):
        cpu_kernels.matmul(jnp.asarray(x), jnp.asarray(packed), out_features + 32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8])
def test_expert_matmul_reads_the_chosen_expert_of_a_packed_stack(dtype):
    """A mixture of experts' stack of packed matrices: each traced expert index gives that expert's product (int8:
    packed with its scales, x rounded to bfloat16 first), and an index past the stack is an error."""
    if dtype != jnp.int8:
        _skip_unless_packed(dtype)
    rng = np.random.default_rng(3)
    experts, rows, k, n = 5, 3, 64, 70
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((experts, n, k)).astype(np.float32)
    if dtype == jnp.int8:
        scale = np.abs(w).max(-1) / 127
        q = np.rint(w / scale[..., None]).astype(np.int8)
        stack = np.stack([cpu_kernels.pack_weight_int8(q[e], scale[e]) for e in range(experts)])
        x_in = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
        # as tests/test_cpu_int8.py: x quantized in blocks of 32 where the build's int8 matmul does
        want = [cpu_kernels.int8_activation_reference(x_in, q[e], scale[e]) if cpu_kernels.int8_quantizes_activations()
                else x_in @ (q[e] * scale[e][:, None]).T for e in range(experts)]
        compute = jnp.bfloat16
    else:
        rounded = np.asarray(jnp.asarray(w).astype(dtype))
        stack = np.stack([cpu_kernels.pack_weight(rounded[e]) for e in range(experts)])
        x_in = np.asarray(jnp.asarray(x).astype(dtype), np.float64)
        want, compute = [x_in @ rounded[e].astype(np.float64).T for e in range(experts)], None
    call = jax.jit(lambda x, w, e: cpu_kernels.expert_matmul(x, w, e, n, compute))
    for e in (0, 3, 4):
        got = np.asarray(call(jnp.asarray(x), jnp.asarray(stack), jnp.int32(e)))
        np.testing.assert_allclose(got, want[e], rtol=1e-5, atol=1e-4)
    with pytest.raises(Exception, match="expert index out of range"):
        np.asarray(call(jnp.asarray(x), jnp.asarray(stack), jnp.int32(experts)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_row_gets_the_same_bits_in_any_batch(dtype):
    """Decode batches of 1-4 rows (matmul_packed.h's RowBlocks) add the same products in the same order as the tiles
    that take larger batches, so a sequence's logits do not depend on what it is batched with."""
    _skip_unless_packed(dtype)
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((9, 576)), jnp.float32)
    packed = jnp.asarray(cpu_kernels.pack_weight(np.asarray(jnp.asarray(rng.standard_normal((200, 576)), dtype))))
    matmul = jax.jit(cpu_kernels.matmul, static_argnums=2)
    batched = np.asarray(matmul(x, packed, 200))  # 9 rows: the tiles
    for rows in (1, 2, 3, 4):
        np.testing.assert_array_equal(np.asarray(matmul(x[9 - rows:], packed, 200)), batched[9 - rows:])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_packed_rows_are_the_table_rows(dtype):
    """A tied embedding table packed for the LM head still answers lookups with its own rows."""
    _skip_unless_packed(dtype)
    rng = np.random.default_rng(3)
    table = jnp.asarray(rng.standard_normal((50, 64)), dtype)
    ids = jnp.asarray([0, 49, 17, 16, 31, 32, 5], jnp.int32)
    got = jax.jit(cpu_kernels.packed_rows)(jnp.asarray(cpu_kernels.pack_weight(np.asarray(table))), ids)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(table[ids].astype(jnp.float32)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_models_load_with_packed_weights(hf_model_dir, dtype):
    """So the parity tests against transformers run the packed kernels here."""
    from jserve.executors import CpuLayerExecutor

    _skip_unless_packed(dtype)
    model = CpuLayerExecutor.load(hf_model_dir("qwen2"), dtype=dtype)  # tied embeddings: the table is packed too
    matrices = [leaf for leaf in jax.tree.leaves(model.state) if leaf.ndim > 1]
    assert matrices and all(cpu_kernels.is_packed(leaf) for leaf in matrices)


def test_argmax_matches_numpy_with_ties_nans_and_infinities():
    """The greedy sampler's argmax: numpy's answer (first maximum; a NaN counts as the maximum)."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((7, 1037)).astype(np.float32)
    x[1, [5, 900]] = 50.0  # a tie: the first wins
    x[2, 1036] = 60.0  # in the scalar tail
    x[3, [17, 400]] = np.nan  # the first NaN wins
    x[4] = -np.inf
    x[5, 3] = np.inf
    x[6, 1030] = np.nan
    got = np.asarray(jax.jit(cpu_kernels.argmax)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    assert got.dtype == np.int32


def test_matmul_keeps_leading_axes_and_rejects_bad_shapes():
    x = jnp.ones((2, 3, 8), jnp.float32)
    w = jnp.full((5, 8), 0.5, jnp.float32)
    np.testing.assert_array_equal(np.asarray(cpu_kernels.matmul(x, w)), np.full((2, 3, 5), 4.0, np.float32))
    with pytest.raises(ValueError, match="matmul"):
        cpu_kernels.matmul(x, jnp.ones((5, 7), jnp.float32))
    with pytest.raises(ValueError, match="matmul"):
        cpu_kernels.matmul(x, jnp.ones((5, 8), jnp.int8))


def test_back_to_back_calls_hand_their_work_to_a_lingering_helper():
    """Calls a moment apart (a decode step's) hand their work to the helper thread the call before left lingering;
    after a pause a call wakes a pool thread again; calls from two threads at once each get their own answer."""
    if cpu_kernels.kernel_threads() < 2:
        pytest.skip("one CPU: the kernels run on the calling thread alone")
    rng = np.random.default_rng(7)
    w = jnp.asarray(rng.standard_normal((2048, 256)), jnp.float32)
    xs = [jnp.asarray(rng.standard_normal((1, 256)), jnp.float32) for _ in range(8)]
    expected = [np.asarray(x, np.float64) @ np.asarray(w, np.float64).T for x in xs]
    matmul = jax.jit(cpu_kernels.matmul)

    def check(i: int) -> None:
        np.testing.assert_allclose(np.asarray(matmul(xs[i], w)), expected[i], rtol=1e-5, atol=1e-4)

    check(0)
    handed = cpu_kernels.handed_calls()
    # Calls queued back to back (checked after) leave the helper microseconds, not its 1 ms linger; a few rounds
    # leave room for a VM that deschedules the helper now and then.
    for _ in range(5):
        outs = [matmul(xs[i % 8], w) for i in range(40)]
        for i, out in enumerate(outs):
            np.testing.assert_allclose(np.asarray(out), expected[i % 8], rtol=1e-5, atol=1e-4)
        if cpu_kernels.handed_calls() > handed:
            break
    assert cpu_kernels.handed_calls() > handed
    time.sleep(0.05)  # past the linger: the helper has gone back to the pool
    check(1)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(check, [i % 8 for i in range(64)]))


@pytest.mark.parametrize("case", CASES + [("mixed", 9, 3, 64, 16, jnp.float32, {}),
                                          ("decode", 9, 3, 64, 32, jnp.bfloat16, {"soft_cap": 30.0}),
                                          # 2 and 4 query heads a KV head: each row count of the AVX2 bf16 path
                                          ("decode", 4, 2, 128, 16, jnp.bfloat16, {}),
                                          ("decode", 8, 2, 64, 16, jnp.bfloat16, {})],
                         ids=lambda c: f"{c[0]}-h{c[1]}kv{c[2]}-d{c[3]}-b{c[4]}-"
                         f"{jnp.dtype(c[5]).name}{'-' + '-'.join(c[6]) if c[6] else ''}")
def test_attention_matches_reference(case):
    batch, heads, kv_heads, head_dim, page_size, dtype, extra = case
    rng = np.random.default_rng(100 + len(str(case)))
    args, ref_meta = make_batch(rng, BATCHES[batch], heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                page_size=page_size, dtype=dtype)
    err = max_error(cpu_kernels.ragged_paged_attention, args, ref_meta, scale=head_dim**-0.5, **extra)
    assert err <= (1e-5 if dtype == jnp.float32 else 2e-2), f"max abs error {err:.3g}"


def test_attention_reads_a_uint16_cache_as_bfloat16_bits():
    """The engine's CPU cache stores bfloat16 as uint16 bits (kv_storage_dtype); the kernel must read them as is."""
    rng = np.random.default_rng(5)
    args, ref_meta = make_batch(rng, BATCHES["mixed"], heads=6, kv_heads=2, head_dim=64, page_size=16,
                                dtype=jnp.bfloat16)
    q, k_pages, v_pages, *meta = args
    as_bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.uint16)
    via_bits = jax.jit(functools.partial(ragged_paged_attention, scale=0.125, backend="cpu"))(
        q, as_bits(k_pages), as_bits(v_pages), *meta)
    direct = jax.jit(functools.partial(cpu_kernels.ragged_paged_attention, scale=0.125))(*args)
    np.testing.assert_array_equal(np.asarray(via_bits), np.asarray(direct))
    assert max_error(cpu_kernels.ragged_paged_attention, args, ref_meta, scale=0.125) <= 2e-2


def test_long_prefill_chunk_over_a_cached_prefix():
    """A 200-token chunk over a 700-token prefix: many query blocks and pages per work item."""
    rng = np.random.default_rng(11)
    args, ref_meta = make_batch(rng, [(200, 900), (1, 300)], heads=9, kv_heads=3, head_dim=64, page_size=16,
                                dtype=jnp.float32)
    assert max_error(cpu_kernels.ragged_paged_attention, args, ref_meta, scale=0.125) <= 1e-5


@pytest.mark.parametrize(("dtype", "extra"), [(jnp.float32, {}), (jnp.bfloat16, {}),
                                             (jnp.float32, {"sliding_window": 300, "soft_cap": 20.0}),
                                             (jnp.bfloat16, {"sliding_window": 300}),
                                             (jnp.float32, {"attention_chunk": 200})])
def test_long_decodes_split_into_parts_match_the_reference(dtype, extra):
    """Decodes over more than 16 pages are split into parts of about equal page counts, merged after; with a
    sliding window only the window's pages are split."""
    rng = np.random.default_rng(23)
    args, ref_meta = make_batch(rng, [(1, 600), (1, 257), (1, 1000), (1, 17), (5, 400)], heads=9, kv_heads=3,
                                head_dim=64, page_size=16, dtype=dtype)
    err = max_error(cpu_kernels.ragged_paged_attention, args, ref_meta, scale=0.125, **extra)
    assert err <= (1e-5 if dtype == jnp.float32 else 2e-2), f"max abs error {err:.3g}"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_decode_attends_to_the_same_bits_alone_and_batched(dtype):
    """How work is split into items may depend on the batch (a lone decode splits over KV heads), but never a
    row's arithmetic: each sequence's row is bit-identical alone or among many (prefill chunks, other decodes).
    The engine's batched == alone parity rests on it."""
    rng = np.random.default_rng(17)
    seqs = [(1, 150), (20, 52), (1, 33), (1, 600), (3, 90), (9, 140), (1, 2)] + [(1, 70)] * 9
    args, ref_meta = make_batch(rng, seqs, heads=9, kv_heads=3, head_dim=64, page_size=16, dtype=dtype)
    q, k_pages, v_pages, page_table, query_start, seq_lens = args
    attend = jax.jit(functools.partial(cpu_kernels.ragged_paged_attention, scale=0.125))
    batched = np.asarray(attend(*args))
    starts = np.asarray(query_start)
    for s, (q_len, _) in enumerate(seqs):
        if q_len > 4:
            continue
        tokens = slice(int(starts[s]), int(starts[s]) + q_len)
        alone = attend(q[tokens], k_pages, v_pages, page_table[s:s + 1], jnp.array([0, q_len], jnp.int32),
                       seq_lens[s:s + 1])
        np.testing.assert_array_equal(np.asarray(alone), batched[tokens], err_msg=f"sequence {s}")
    err = max_error(cpu_kernels.ragged_paged_attention, args, ref_meta, scale=0.125)
    assert err <= (1e-5 if dtype == jnp.float32 else 2e-2), f"max abs error {err:.3g}"


# (pages, batch, heads, kv_heads, extra): a sliding window, GQA 3 and 4, decodes split into parts (the 600-token
# decode; with a window, only its window's pages) in batches of mixed prefill chunks and decodes.
SINK_CASES = [("float32", BATCHES["mixed"], 8, 2, {"sliding_window": 20}),
              ("bfloat16", BATCHES["decode"] + [(1, 600)], 6, 2, {}),
              ("uint16", BATCHES["mixed"] + [(1, 600)], 8, 2, {"soft_cap": 20.0}),
              ("int8", BATCHES["mixed"] + [(1, 600)], 6, 2, {"sliding_window": 300})]


@pytest.mark.parametrize(("pages", "seqs", "heads", "kv_heads", "extra"), SINK_CASES,
                         ids=[f"{c[0]}-h{c[2]}kv{c[3]}{'-' + '-'.join(c[4]) if c[4] else ''}" for c in SINK_CASES])
def test_attention_sinks_match_the_reference(pages, seqs, heads, kv_heads, extra):
    """gpt-oss's attention sinks: query head h's softmax denominator gains exp(sinks[h]). The reference reads the
    same values as float32 (bfloat16 values, int8 times its row's scale), so every cache dtype matches it tightly;
    sinks of realistic size change the result, and indexed by KV head, dropped or added twice they would not match."""
    rng = np.random.default_rng(31)
    dtype = jnp.float32 if pages in ("float32", "int8") else jnp.bfloat16
    args, (token_seq, positions, num_real) = make_batch(rng, seqs, heads=heads, kv_heads=kv_heads, head_dim=64,
                                                        page_size=16, dtype=dtype)
    q, k_pages, v_pages, *meta = args
    q = q.astype(jnp.float32)
    k_ref, v_ref = k_pages.astype(jnp.float32), v_pages.astype(jnp.float32)
    scales = {}
    if pages == "int8":  # each (token, KV head) row quantized as the engine writes it: max|row| / 127
        quantized = []
        for x in (k_ref, v_ref):
            scale = jnp.max(jnp.abs(x), axis=-1) / 127
            quantized.append((jnp.round(x / scale[..., None]).astype(jnp.int8), scale))
        (k_pages, k_scale), (v_pages, v_scale) = quantized
        k_ref, v_ref = (values.astype(jnp.float32) * s[..., None] for values, s in quantized)
        scales = {"k_scales": k_scale, "v_scales": v_scale}
    elif pages == "uint16":
        k_pages, v_pages = (jax.lax.bitcast_convert_type(x, jnp.uint16) for x in (k_pages, v_pages))
    sinks = jnp.asarray(rng.normal(size=heads) * 2, jnp.float32)
    attend = jax.jit(lambda q, k, v, sinks, *meta: cpu_kernels.ragged_paged_attention(
        q, k, v, *meta, scale=0.125, sinks=sinks, **scales, **extra))
    got = np.asarray(attend(q, k_pages, v_pages, sinks, *meta))
    ref = np.asarray(ragged_paged_attention_ref(q, k_ref, v_ref, meta[0], jnp.asarray(token_seq),
                                                jnp.asarray(positions), scale=0.125, sinks=sinks, **extra))
    assert np.all(got[num_real:] == 0), "padding tokens must come out as zeros"
    np.testing.assert_allclose(got[:num_real], ref[:num_real], rtol=1e-5, atol=1e-5)
    without = np.asarray(attend(q, k_pages, v_pages, None, *meta))
    assert np.abs(without - got)[:num_real].max() > 1e-2, "the sinks must change the result"


def test_unavailable_kernels_fall_back_to_the_reference(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_load", lambda: cpu_kernels.KernelUnavailable("no C++ compiler"))
    assert resolve_backend("auto", "cpu") == "reference"
    with pytest.raises(ValueError, match="no C\\+\\+ compiler"):
        resolve_backend("cpu", "cpu")
    with pytest.raises(ValueError, match="CPU only"):
        resolve_backend("cpu", "tpu")


def test_read_bandwidth_is_of_the_order_of_a_numpy_copy():
    """The roofline's bandwidth (all cores reading) against what numpy measures on one core: same order."""
    import time

    bandwidth = cpu_kernels.read_bandwidth(64 << 20, repeats=2)
    src = np.ones(16 << 20, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    start = time.perf_counter()
    np.copyto(dst, src)
    copy = 2 * src.nbytes / (time.perf_counter() - start)
    assert 0.2 * copy < bandwidth < 50 * copy


@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD"])
def test_intel_builds_get_jserve_intel(monkeypatch, vendor):
    """Intel builds get JSERVE_INTEL (the weight stream's T0 and far T2 prefetches, widened bfloat16 tiles), others
    not. Whichever CPU runs the tests, every ISA variant builds both ways (test_cpu_kernels_isa.py)."""
    info = {"vendor_id": vendor}
    monkeypatch.setattr(cpu_kernels, "_cpuinfo", lambda field: info.get(field, ""))
    flags = cpu_kernels._build_flags()
    assert ("-DJSERVE_INTEL" in flags) == (vendor == "GenuineIntel")
    assert flags[: len(cpu_kernels.CXXFLAGS)] == cpu_kernels.CXXFLAGS
