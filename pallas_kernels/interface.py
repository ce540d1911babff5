"""The one attention interface the models call, and the choice of backend behind it.

Spec of `ragged_paged_attention` (every backend computes exactly this; reference.ragged_paged_attention_ref, a
dense gather, defines it):

  q            [T, H, D]       float32 or bfloat16. Queries of every scheduled token, flattened over sequences in
                               row order: sequence s owns tokens query_start[s] .. query_start[s+1]-1.
  k_pages      [N, B, Hkv, D]  one layer's key cache, same dtype as v_pages: N pages of B token slots. A token's
  v_pages                      K/V sit at page page_table[s, pos // B], slot pos % B. Token-major pages keep each
                               token's K/V for all heads contiguous, so the per-token write (write_kv) is one
                               contiguous row, and a page is one contiguous block for whole-page DMAs.
  page_table   [S, P] int32    page ids of each sequence's logical blocks; entries past a sequence's length may be
                               any valid page id (they are never read).
  query_start  [S + 1] int32   non-decreasing; rows past the real sequences repeat the total (zero new tokens).
                               Tokens at or after query_start[S] are padding.
  seq_lens     [S] int32       KV length of each sequence after this step, new tokens included (their K/V are
                               already written). Sequence s's new tokens are its last q_len = query_start[s+1] -
                               query_start[s] positions: seq_lens[s] - q_len .. seq_lens[s] - 1.
  (quantized)  k_pages/v_pages may each be a QuantizedPages (pallas_kernels/quantized.py): int8 or float8_e4m3fn
                               values [N, B, Hkv, D] and float32 scales [N, B, Hkv], value = stored * scale,
                               one scale per (token, KV head) row; attention computes in its `dtype`.
  scale        float           multiplies q.k (usually D ** -0.5).
  sliding_window int | None    a token at position p sees keys p - window + 1 .. p (Mistral's convention).
  attention_chunk int | None   a token at position p sees keys (p // chunk) * chunk .. p, its own chunk's (Llama 4's
                               chunked attention; never with sliding_window).
  soft_cap     float | None    scaled logits s become soft_cap * tanh(s / soft_cap) (Gemma 2's convention).
  sinks        [H] float32     attention sinks (gpt-oss; None: none): query head h's softmax denominator gains
               or None         exp(sinks[h]), as if each sequence had one more key whose value is zero:
                               out = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sinks[h] - m)).
  returns      [T, H, D] float32; rows of padding tokens are unspecified (the kernels write zeros).

Each token attends causally to keys 0..its position of its own sequence (so a prefill chunk is causal within
itself and sees the cached prefix), with query head j reading KV head j // (H // Hkv) (GQA). Prefill chunks and
decodes mix freely in one call. The KV layout is one thing for every backend; docs/kernels.md says why it suits
both the TPU DMAs and the Triton loads.

Backends: "reference" (pure JAX: reference.ragged_paged_attention_chunked, the definition's result computed a
chunk of pages at a time up to the furthest position, so its cost follows the sequences, not the table), "cpu"
(cpu_kernels: a C++ kernel through XLA's FFI, the fast path on CPU), "pallas" (the kernel for the current
platform: Mosaic on TPU, Triton on GPU), "pallas-interpret" (the Mosaic kernel run by the Pallas interpreter on any
platform), and "pallas-interpret-tpu" / "pallas-interpret-gpu" to interpret one kernel in particular.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import cpu_kernels
from pallas_kernels.blocks import row_of
from pallas_kernels.gpu import ragged_paged_attention_gpu, takes_head_dim
from pallas_kernels.quantized import QuantizedPages
from pallas_kernels.reference import from_stored, ragged_paged_attention_chunked, write_kv_ref
from pallas_kernels.tpu import ragged_paged_attention_tpu
from sharding.kernels import HEADS, KV_HEADS, model_parallel_mesh
from sharding.mesh import MODEL_AXIS

KV_SCALE_HEADS = P(None, None, MODEL_AXIS)  # a quantized cache's scales: [pages, page_slot, kv_heads]

ENGINE_BACKENDS = ("auto", "reference", "cpu", "pallas", "pallas-interpret", "pallas-interpret-gpu")
BACKENDS = ("reference", "cpu", "pallas", "pallas-interpret", "pallas-interpret-tpu", "pallas-interpret-gpu")
_KERNEL_PLATFORMS = ("tpu", "gpu")


def resolve_backend(backend: str, platform: str | None = None) -> str:
    """Turn an engine setting into a concrete backend: "auto" is the Pallas kernel on TPU/GPU, and on CPU the C++
    kernels where they build here (cpu_kernels.available()), else the reference."""
    platform = platform or jax.default_backend()
    if backend not in ENGINE_BACKENDS and backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {ENGINE_BACKENDS}, got {backend!r}")
    if backend == "auto":
        if platform in _KERNEL_PLATFORMS:
            return "pallas"
        return "cpu" if platform == "cpu" and cpu_kernels.available() else "reference"
    if backend == "cpu" and platform != "cpu":
        raise ValueError(f"attention_backend 'cpu' runs on the CPU only (platform is {platform!r})")
    if backend == "cpu" and not cpu_kernels.available():
        raise ValueError(f"attention_backend 'cpu' is unavailable: {cpu_kernels.unavailable_reason()}")
    if backend == "pallas" and platform not in _KERNEL_PLATFORMS:
        raise ValueError(f"attention_backend 'pallas' needs a TPU or GPU (platform is {platform!r}); "
                         "use 'pallas-interpret' to run the kernels on the CPU, or 'reference'")
    return backend


def token_positions(query_start: jax.Array, seq_lens: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """(token_seq, positions) [T] from the ragged metadata; padding tokens get row 0, position 0."""
    num_seqs = seq_lens.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.minimum(row_of(query_start[1:], t), num_seqs - 1).astype(jnp.int32)
    pos = seq_lens[seq] - (query_start[seq + 1] - query_start[seq]) + (t - query_start[seq])
    real = t < query_start[num_seqs]
    return jnp.where(real, seq, 0), jnp.where(real, pos, 0)


def ragged_paged_attention(q: jax.Array, k_pages: jax.Array | QuantizedPages, v_pages: jax.Array | QuantizedPages,
                           page_table: jax.Array,
                           query_start: jax.Array, seq_lens: jax.Array, *, scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           sinks: jax.Array | None = None, backend: str = "reference",
                           attention_chunk: int | None = None) -> jax.Array:
    """Attention of every token over its own sequence's paged KV; the spec is in this module's docstring."""
    if sliding_window is not None and attention_chunk is not None:
        raise ValueError("ragged_paged_attention: a sliding window or an attention chunk, not both")
    kwargs = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, attention_chunk=attention_chunk)
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    quantized = isinstance(k_pages, QuantizedPages)
    if quantized and backend == "cpu" and k_pages.values.dtype != jnp.int8:
        raise ValueError("attention backend 'cpu' (the C++ kernel) reads int8 pages but not fp8 ones "
                         "(kv_cache_dtype fp8); use attention_backend 'reference'")
    if backend != "reference" and model_parallel_mesh() is not None:
        # Tensor parallelism: each device runs the kernel on its own heads (the reference is left to GSPMD); a
        # quantized cache's scales [N, B, Hkv] and the sinks [H] split over heads with them.
        def attention(*args: jax.Array) -> jax.Array:
            return ragged_paged_attention(*args[:6], sinks=args[6] if len(args) > 6 else None, backend=backend,
                                          **kwargs)

        kv_spec = QuantizedPages(KV_HEADS, KV_SCALE_HEADS, k_pages.dtype) if quantized else KV_HEADS
        args, specs = (q, k_pages, v_pages, page_table, query_start, seq_lens), (HEADS, kv_spec, kv_spec, P(), P(), P())
        if sinks is not None:
            args, specs = (*args, sinks), (*specs, P(MODEL_AXIS))
        return jax.shard_map(attention, in_specs=specs, out_specs=HEADS, check_vma=False)(*args)
    return _attention(q, k_pages, v_pages, page_table, query_start, seq_lens, sinks, backend=backend, **kwargs)


# Jitted so that a model's layers, which call attention with the same shapes, share one trace and one lowering of it
# per step shape instead of one per layer (jit caches the trace by shapes; the lowered module calls one function
# from every layer, and XLA inlines the calls back, so the compiled step is the same). For a 32-layer model on the
# Triton kernel that takes the step's trace and lowering from ~3 s to ~0.5 s (docs/kernels.md).
@functools.partial(jax.jit, static_argnames=("backend", "scale", "sliding_window", "soft_cap", "attention_chunk"))
def _attention(q: jax.Array, k_pages: jax.Array | QuantizedPages, v_pages: jax.Array | QuantizedPages,
               page_table: jax.Array, query_start: jax.Array, seq_lens: jax.Array, sinks: jax.Array | None, *,
               backend: str, scale: float, sliding_window: int | None, soft_cap: float | None,
               attention_chunk: int | None = None) -> jax.Array:
    kwargs = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks,
                  attention_chunk=attention_chunk)
    if backend == "reference":  # the engine's pure-JAX attention: the definition's result, chunk by chunk
        token_seq, positions = token_positions(query_start, seq_lens, q.shape[0])
        return ragged_paged_attention_chunked(q, k_pages, v_pages, page_table, token_seq, positions, **kwargs)
    if backend == "cpu" and isinstance(k_pages, QuantizedPages):  # int8 rows widened and scaled as the kernel reads
        return cpu_kernels.ragged_paged_attention(q, k_pages.values, v_pages.values, page_table, query_start, seq_lens,
                                                  k_scales=k_pages.scales, v_scales=v_pages.scales, **kwargs)
    if backend == "cpu":  # reads a uint16 (bfloat16 bits) cache as it is
        return cpu_kernels.ragged_paged_attention(q, k_pages, v_pages, page_table, query_start, seq_lens, **kwargs)
    # The kernels read values; a CPU cache stores bfloat16 as uint16 bits (see kv_storage_dtype), e4m3 as uint8.
    args = (q, _kernel_pages(k_pages), _kernel_pages(v_pages), page_table, query_start, seq_lens)
    if backend == "pallas":
        # Chosen by the platform being lowered for, not the host's: jax.export from a CPU host for tpu or cuda
        # gets that platform's kernel (and lowering for CPU fails: there is no branch for it). Every branch is
        # traced; cuda and rocm share one callable so that the Triton kernel is traced once.
        triton = functools.partial(ragged_paged_attention_gpu, **kwargs)
        if not takes_head_dim(q.shape[-1]):  # a head_dim Triton cannot tile (e.g. 72 = 64 + 8): the reference there
            def triton(*_: jax.Array) -> jax.Array:
                return _attention(q, k_pages, v_pages, page_table, query_start, seq_lens, sinks, backend="reference",
                                  scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
                                  attention_chunk=attention_chunk)
        return jax.lax.platform_dependent(*args, tpu=functools.partial(ragged_paged_attention_tpu, **kwargs),
                                          cuda=triton, rocm=triton)
    if backend in ("pallas-interpret", "pallas-interpret-tpu"):
        return ragged_paged_attention_tpu(*args, **kwargs, interpret=True)
    return ragged_paged_attention_gpu(*args, **kwargs, interpret=True)  # "pallas-interpret-gpu"


def _kernel_pages(pages: jax.Array | QuantizedPages) -> jax.Array | QuantizedPages:
    """The cache as the kernels read it: values, not their storage bits."""
    if not isinstance(pages, QuantizedPages):
        return from_stored(pages)
    if pages.values.dtype == jnp.uint8:
        return QuantizedPages(jax.lax.bitcast_convert_type(pages.values, jnp.float8_e4m3fn), pages.scales, pages.dtype)
    return pages


def write_kv(k_pages: jax.Array, v_pages: jax.Array | None, k: jax.Array, v: jax.Array | None,
             slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """Write new K/V [T, Hkv, D] into flat slots (page * B + offset); slot N * B (padding) is dropped. Without
    v_pages (latent attention, whose values are its keys' pages) only the keys are written.

    Every backend uses this XLA scatter: inside the jitted step the caches are donated, so XLA updates them in
    place (no copy of the cache), and it fuses with the K/V projection. A kernel would save nothing: the write
    moves T * Hkv * D elements, far less than attention reads.
    """
    return write_kv_ref(k_pages, v_pages, k, v, slot_mapping)
