"""Section kernels: the Triton ragged paged attention kernel against the reference on ragged mixed batches, then its
time against XLA's gather-based attention (the dense definition) and the engine's pure-JAX attention (page chunks,
the "reference" backend) at Llama-3-8B decode shapes.

Correctness: every real token's output against the reference computed in float32 from the same inputs, as
||out - ref|| / ||ref|| (bf16 operands land near 1e-3, float32 near 1e-7), padding rows must be zeros, and each
batch is drawn afresh. Time: a jitted loop of `reps` calls (the query perturbed per call so nothing is hoisted),
over its count, so dispatch costs stay out of a kernel that runs for microseconds. One more run of the kernel's
loop under the profiler splits its time between the kernel itself and the XLA ops around it.
"""

from __future__ import annotations

import functools
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gpu_check.common import section_args
from pallas_kernels import blocks, ragged_paged_attention, ragged_paged_attention_gpu, ragged_paged_attention_ref
from pallas_kernels.gpu import auto_kv_splits
from pallas_kernels.interface import token_positions

# (q_len, kv_len) per sequence: decodes at several lengths, prefill chunks over cached prefixes, whole prompts.
MIXED = [(1, 1), (1, 17), (1, 300), (37, 37), (1, 1000), (64, 600), (5, 130), (1, 64), (128, 128), (1, 2049)]
MIXED_CPU = [(1, 1), (1, 17), (9, 40), (1, 64), (20, 20)]
# (heads, kv_heads, head_dim, page_size, dtype, extra): GQA 1, 4, 8 at head_dim 64 and 128 on the engine's page
# size, then a sliding window, a soft cap, page sizes 32 and 64, float32, split-KV forced on a mixed batch, and
# Gemma's head_dim 256 (Gemma 3 1B's heads; Gemma 2 2B's with its window and soft cap), then head dims the kernel runs
# as power-of-two chunks: Phi-3-mini's 96 and DeepSeek-V2-Lite's latent attention (16 heads over one KV head of 576).
CASES = [
    (8, 8, 128, 16, "bfloat16", {}), (32, 8, 128, 16, "bfloat16", {}), (32, 4, 128, 16, "bfloat16", {}),
    (8, 8, 64, 16, "bfloat16", {}), (16, 4, 64, 16, "bfloat16", {}), (16, 2, 64, 16, "bfloat16", {}),
    (32, 8, 128, 16, "bfloat16", {"sliding_window": 256}), (32, 8, 128, 16, "bfloat16", {"soft_cap": 30.0}),
    (32, 8, 128, 32, "bfloat16", {}), (32, 8, 128, 64, "bfloat16", {}), (32, 8, 128, 16, "float32", {}),
    (32, 8, 128, 16, "bfloat16", {"kv_splits": 4}), (14, 2, 64, 16, "bfloat16", {}),
    (4, 1, 256, 16, "bfloat16", {}), (8, 4, 256, 16, "bfloat16", {"sliding_window": 512, "soft_cap": 50.0}),
    (32, 32, 96, 16, "bfloat16", {}), (16, 1, 576, 16, "bfloat16", {}),
]
TOLERANCE = {"bfloat16": 1e-2, "float32": 1e-5}


def ragged_batch(rng: np.random.Generator, seqs, *, heads, kv_heads, head_dim, page_size, dtype, pad_tokens=5,
                 pad_seqs=3):
    """Random q and paged K/V for `seqs` (pages shuffled over the cache, padding tokens and rows) -> kernel args."""
    q_lens = np.array([q for q, _ in seqs], np.int32)
    kv_lens = np.array([kv for _, kv in seqs], np.int32)
    num_seqs, num_tokens = len(seqs) + pad_seqs, int(q_lens.sum()) + pad_tokens
    pages = -(-kv_lens // page_size)
    num_pages = int(pages.sum()) + 3
    perm = rng.permutation(num_pages)
    page_table = np.full((num_seqs, int(pages.max()) + 2), perm[-1], np.int32)
    used = 0
    for s, n in enumerate(pages):
        page_table[s, :n] = perm[used: used + n]
        used += n
    query_start = np.full(num_seqs + 1, q_lens.sum(), np.int32)
    query_start[: len(seqs) + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    seq_lens = np.zeros(num_seqs, np.int32)
    seq_lens[: len(seqs)] = kv_lens
    cache = (num_pages, page_size, kv_heads, head_dim)
    arrays = [rng.standard_normal((num_tokens, heads, head_dim)), rng.standard_normal(cache),
              rng.standard_normal(cache)]
    q, k, v = (jnp.asarray(a, dtype) for a in arrays)
    return (q, k, v, jnp.asarray(page_table), jnp.asarray(query_start), jnp.asarray(seq_lens)), int(q_lens.sum())


def check_case(rng, case, kernel_backend: str, seqs) -> dict:
    heads, kv_heads, head_dim, page_size, dtype, extra = case
    args, num_real = ragged_batch(rng, seqs, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                  page_size=page_size, dtype=dtype)
    q, k, v, page_table, query_start, seq_lens = args
    features = {key: extra[key] for key in ("sliding_window", "soft_cap") if key in extra}
    scale = head_dim**-0.5
    if "kv_splits" in extra:
        interpret = kernel_backend != "pallas"
        kernel = jax.jit(functools.partial(ragged_paged_attention_gpu, scale=scale, interpret=interpret,
                                           kv_splits=extra["kv_splits"], **features))
    else:
        kernel = jax.jit(functools.partial(ragged_paged_attention, scale=scale, backend=kernel_backend, **features))
    out = np.asarray(kernel(*args))
    token_seq, positions = token_positions(query_start, seq_lens, q.shape[0])
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    ref = np.asarray(ragged_paged_attention_ref(f32[0], f32[1], f32[2], page_table, token_seq, positions,
                                                scale=scale, **features))[:num_real]
    error = float(np.linalg.norm(out[:num_real] - ref) / np.linalg.norm(ref))
    padding_zero = bool(np.all(out[num_real:] == 0))
    ok = error <= TOLERANCE[dtype] and padding_zero and bool(np.isfinite(out).all())
    return {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "page_size": page_size, "dtype": dtype,
            **extra, "tokens": num_real, "rel_error": error, "padding_zero": padding_zero, "ok": ok}


def decode_batch(batch: int, context: int, *, heads, kv_heads, head_dim, page_size, dtype, key):
    """A decode-only batch of `batch` sequences at `context` keys, each on its own pages; the page table is exactly
    as wide as the context (the reference gathers every column, as the engine's bucketed table would)."""
    width = context // page_size
    num_pages = batch * width
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (batch, heads, head_dim), dtype)
    k = jax.random.normal(kk, (num_pages, page_size, kv_heads, head_dim), dtype)
    v = jax.random.normal(kv, (num_pages, page_size, kv_heads, head_dim), dtype)
    page_table = jnp.asarray(np.random.default_rng(batch).permutation(num_pages).reshape(batch, width), jnp.int32)
    query_start = jnp.arange(batch + 1, dtype=jnp.int32)
    seq_lens = jnp.full((batch,), context, jnp.int32)
    return q, k, v, page_table, query_start, seq_lens


def dense_gather(q, k_pages, v_pages, page_table, query_start, seq_lens, *, scale):
    """XLA's gather-based attention: every token gathers its sequence's whole page-table row (the definition)."""
    token_seq, positions = token_positions(query_start, seq_lens, q.shape[0])
    return ragged_paged_attention_ref(q, k_pages, v_pages, page_table, token_seq, positions, scale=scale)


def attention_loop(attention, reps: int):
    """A jitted loop of reps calls of attention(q, *rest), each on a perturbed q, summed."""

    @jax.jit
    def loop(q, *rest):
        def body(i, acc):
            out = attention(q * (1 + i.astype(q.dtype) * 1e-3), *rest)
            return acc + out.sum()

        return jax.lax.fori_loop(0, reps, body, jnp.float32(0))

    return loop


def time_loop(loop, args, reps: int) -> float:
    """Seconds per call of an attention_loop of reps calls."""
    loop(*args).block_until_ready()  # compile and warm
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        loop(*args).block_until_ready()
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def traced_split(loop, args, reps: int) -> dict:
    """Where a call's time goes, from one traced run of the timing loop: µs per call in the attention kernel itself
    and in everything else the loop runs (the XLA ops around the kernel: block metadata, q packing, the split
    merge, unpacking; and the loop's perturb-and-sum), with the device's busy µs per call. A GPU trace's kernels;
    on a CPU, XLA's thunks (the interpreted kernel has no kernel of its own there: all of it counts as other)."""
    from benchmarks.gpu_check.profile import profiler_options, summarize, xplane_files

    with tempfile.TemporaryDirectory(prefix="gpu_check_kernels_") as trace_dir:
        with jax.profiler.trace(trace_dir, profiler_options=profiler_options()):
            loop(*args).block_until_ready()
        paths = xplane_files(trace_dir)
        kinds = summarize(paths, reps)["kinds"] if paths else {}
    source = next((k for k in ("kernels", "host_xla_ops") if k in kinds), None)
    if source is None:
        return {"trace_source": None}
    agg = kinds[source]
    categories = agg["categories_us_per_token"]
    return {"trace_source": source, "kernel_us": categories["attention"],
            "other_us": sum(v for k, v in categories.items() if k != "attention"), "busy_us": agg["busy_us_per_token"]}


def with_searchsorted_loop(attention):
    """attention with the blocks' sequence search as jnp.searchsorted's default method (a while loop) instead of
    blocks.row_of's unrolled one: timed beside the default, it shows what the loop costs a call."""

    def run(*args):
        unrolled = blocks.row_of
        blocks.row_of = lambda ends, items: jnp.searchsorted(ends, items, side="right")
        try:
            return attention(*args)
        finally:
            blocks.row_of = unrolled

    return run


def main() -> None:
    args, results = section_args()
    on_gpu = jax.default_backend() == "gpu"
    kernel_backend = "pallas" if on_gpu else "pallas-interpret-gpu"
    rng = np.random.default_rng(0)
    cases = CASES if on_gpu else CASES[:2] + CASES[6:8] + CASES[10:12] + CASES[-3:-2]
    if args.get("kernel_cases"):
        cases = [c for c in cases if f"{c[0]}/{c[1]}/{c[2]}/{c[3]}/{c[4]}" in args["kernel_cases"]]
    for case in cases:
        try:
            results.append("correctness", check_case(rng, case, kernel_backend, MIXED if on_gpu else MIXED_CPU))
        except Exception as e:  # one failing configuration must not hide the others
            results.append("correctness", {"case": repr(case), "ok": False, "error": f"{type(e).__name__}: {e}"})
    bandwidth = args.get("hbm_gb_per_s")
    shape = dict(heads=32, kv_heads=8, head_dim=128, page_size=16, dtype=jnp.bfloat16)
    # Batch 1 at 256 keys is the batch-1 decode of the speed section (128 + 256 tokens).
    grid = [(1, 256)] + [(b, c) for c in (1024, 8192) for b in (1, 32, 256)] if on_gpu else [(4, 256)]
    if args.get("kernel_timing") is False:
        grid = []
    if not on_gpu:
        shape.update(heads=8, kv_heads=2, head_dim=64)
    for batch, context in grid:
        try:
            q, k, v, page_table, query_start, seq_lens = decode_batch(batch, context, key=jax.random.key(batch),
                                                                      **shape)
            rest = (k, v, page_table, query_start, seq_lens)
            kv_bytes = 2 * batch * context * shape["kv_heads"] * shape["head_dim"] * jnp.dtype(shape["dtype"]).itemsize
            reps = max(2, min(200, int(2e9 / kv_bytes))) if on_gpu else 2
            scale = shape["head_dim"] ** -0.5
            entry = {"batch": batch, "context": context, "kv_bytes": kv_bytes}
            if on_gpu:
                variants = {"pallas": functools.partial(ragged_paged_attention, scale=scale, backend="pallas"),
                            "pallas_no_split": functools.partial(ragged_paged_attention_gpu, scale=scale, kv_splits=1)}
                if args.get("kernel_variants"):  # tuning candidates, timed beside the default in the same run
                    splits = min(16, 4 * auto_kv_splits(batch * shape["kv_heads"]))
                    gpu = functools.partial(ragged_paged_attention_gpu, scale=scale)
                    variants.update(pallas_splits_x4=functools.partial(gpu, kv_splits=splits),
                                    pallas_stages3=functools.partial(gpu, num_stages=3),
                                    pallas_warps2=functools.partial(gpu, num_warps=2),
                                    pallas_128_keys=functools.partial(gpu, pages_per_step=8))
            else:
                variants = {"pallas": functools.partial(ragged_paged_attention_gpu, scale=scale, interpret=True),
                            "pallas_no_split": functools.partial(ragged_paged_attention_gpu, scale=scale,
                                                                 interpret=True, kv_splits=1)}
            variants["pallas_searchsorted_loop"] = with_searchsorted_loop(variants["pallas"])
            variants["xla_gather"] = functools.partial(dense_gather, scale=scale)
            variants["xla_chunked"] = functools.partial(ragged_paged_attention, scale=scale, backend="reference")
            entry["auto_kv_splits"] = auto_kv_splits(batch * shape["kv_heads"])
            for name, fn in variants.items():
                loop = attention_loop(fn, reps)
                seconds = time_loop(loop, (q, *rest), reps)
                if name == "pallas":
                    split = traced_split(loop, (q, *rest), reps)
                    entry.update({f"pallas_traced_{k}": v for k, v in split.items()})
                entry[f"{name}_us"] = seconds * 1e6
                entry[f"{name}_gb_per_s"] = kv_bytes / seconds / 1e9
                if bandwidth:
                    entry[f"{name}_share_of_hbm"] = kv_bytes / seconds / 1e9 / bandwidth
            entry["pallas_over_xla"] = entry["xla_gather_us"] / entry["pallas_us"]
            results.append("decode_timing", entry)
            del q, rest, k, v
        except Exception as e:
            results.append("decode_timing", {"batch": batch, "context": context,
                                             "error": f"{type(e).__name__}: {e}"[:2000]})


if __name__ == "__main__":
    main()
