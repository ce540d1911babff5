"""CPU kernels (C++: kernels.cc and the parts it includes) called from jitted code through XLA's FFI: matmul, ragged
paged attention, the decoder layers and argmax.

XLA's CPU backend runs a decode step's small matmuls far below memory bandwidth with a fixed cost per op, and its
paged attention must gather every page of every token first (docs/benchmarks.md). These kernels are to the CPU what
the Pallas kernels are to TPU and GPU. The C++ source is compiled once per machine on first use with the system's
C++ compiler (-march=native) into ~/.cache/jserve/cpu_kernels/, keyed by a hash of every source file, the flags and
the compiler; where that is impossible (no compiler, no AVX2/FMA) `available()` is False and `unavailable_reason()`
says why, and "auto" falls back to pure XLA. With JSERVE_CPU_KERNELS_LIB set, the library at that path (built by
`build`, e.g. for one ISA variant) is loaded instead.

References: `matmul_ref` here, pallas_kernels.reference.ragged_paged_attention_ref for attention, and the
model's own per-op layers (jserve.models.llama, reference attention backend) for `decoder_layers`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# The packed layout lives in its own module; its names are this package's too.
from cpu_kernels.packing import INT8_SCALE_ROWS as INT8_SCALE_ROWS
from cpu_kernels.packing import PACKED_ROWS as PACKED_ROWS
from cpu_kernels.packing import is_packed as is_packed
from cpu_kernels.packing import is_packed_stack as is_packed_stack
from cpu_kernels.packing import pack_weight as pack_weight
from cpu_kernels.packing import pack_weight_int8 as pack_weight_int8
from cpu_kernels.packing import packed_rows as packed_rows

SOURCE = Path(__file__).with_name("kernels.cc")  # the one translation unit: it includes every part (*.h beside it)
# On an AVX2 machine the kernel matches XLA's float32 dot at prefill sizes and beats its bfloat16 dot 1.7x, so it takes
# every batch; where the CPU has AMX, XLA's bfloat16 dot runs on it, and the kernel keeps only decode-sized batches.
AMX_KERNEL_ROWS = 64
LIBRARY_FLAGS = ("-std=c++17", "-shared", "-fPIC")  # what any build of the kernels needs
CXXFLAGS = ("-O3", "-march=native", "-mavx2", "-mfma", *LIBRARY_FLAGS)
LIBRARY_ENV = "JSERVE_CPU_KERNELS_LIB"  # a library to load instead of building one for this machine


class KernelUnavailable(RuntimeError):
    pass


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "jserve" / "cpu_kernels"


def sources() -> list[Path]:
    """Every C++ source file: kernels.cc and the headers it includes (all of them in the build's cache key)."""
    return sorted(SOURCE.parent.glob("*.h")) + [SOURCE]


def compiler() -> str | None:
    """The C++ compiler the kernels are built with: $CXX, else g++, c++ or clang++ (None: none is installed)."""
    return next((c for c in (os.environ.get("CXX"), "g++", "c++", "clang++") if c and shutil.which(c)), None)


def build(out: Path, flags: Sequence[str] = CXXFLAGS) -> Path:
    """Compiles the kernels with exactly these compiler flags (CXXFLAGS: for this machine) into the library `out`,
    which JSERVE_CPU_KERNELS_LIB can then name; raises KernelUnavailable if the compiler fails or there is none.
    The tests build each ISA variant the source keeps this way, with explicit -m flags."""
    cxx = compiler()
    if cxx is None:
        raise KernelUnavailable("no C++ compiler (g++, c++ or clang++) to build the CPU kernels")
    _compile(cxx, flags, jax.ffi.include_dir(), Path(out))
    return Path(out)


def _compile(cxx: str, flags: Sequence[str], include_dir: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_lib = Path(tmp) / out.name
        cmd = [cxx, *flags, f"-I{include_dir}", str(SOURCE), "-o", str(tmp_lib)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise KernelUnavailable(f"compiling {SOURCE.name} failed ({' '.join(cmd)}):\n{result.stderr[-2000:]}")
        os.replace(tmp_lib, out)  # atomic: concurrent processes each build, one file wins


@functools.cache
def _cpuinfo(field: str) -> str:
    """The first value of `field` in /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == field:
                    return value.strip()
    except OSError:
        pass
    return ""


@functools.cache
def _cpu_flags() -> frozenset[str]:
    return frozenset(_cpuinfo("flags").split())


def _build_flags() -> tuple[str, ...]:
    """CXXFLAGS, plus JSERVE_INTEL on Intel CPUs: there the weight stream prefetches T0 2 KiB ahead and T2 8 KiB
    ahead, not non-temporal 512 bytes ahead, and bfloat16 tiles run widened to float32 (prefetch.h and
    matmul_packed.h's WidenedBlocks say why)."""
    return CXXFLAGS + (("-DJSERVE_INTEL",) if _cpuinfo("vendor_id") == "GenuineIntel" else ())


def _built_library() -> Path:
    """This machine's build of the kernels, from the cache, compiled first if it is not there."""
    cxx = compiler()
    if cxx is None:
        raise KernelUnavailable("no C++ compiler (g++, c++ or clang++) to build the CPU kernels")
    flags = _build_flags()
    identity = [jax.__version__, cxx, *flags, *sorted(_cpu_flags())]
    source = b"".join(path.name.encode() + b"\0" + path.read_bytes() for path in sources())
    key = hashlib.sha256(source + " ".join(identity).encode()).hexdigest()[:16]
    lib_path = _cache_dir() / f"libjserve_cpu_{key}.so"
    if not lib_path.exists():
        _compile(cxx, flags, jax.ffi.include_dir(), lib_path)
    return lib_path


@functools.cache
def _load() -> ctypes.CDLL | KernelUnavailable:
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return KernelUnavailable(f"the CPU kernels are built for x86-64 Linux (this is {sys.platform}/"
                                 f"{platform.machine()})")
    if not {"avx2", "fma"} <= _cpu_flags():
        return KernelUnavailable("the CPU kernels need AVX2 and FMA, which this CPU lacks")
    try:
        lib_path = os.environ.get(LIBRARY_ENV) or _built_library()
        lib = ctypes.cdll.LoadLibrary(str(lib_path))
        jax.ffi.register_ffi_target("jserve_matmul", jax.ffi.pycapsule(lib.JserveMatmul), platform="cpu")
        jax.ffi.register_ffi_target("jserve_expert_matmul", jax.ffi.pycapsule(lib.JserveExpertMatmul),
                                    platform="cpu")
        jax.ffi.register_ffi_target("jserve_paged_attention", jax.ffi.pycapsule(lib.JservePagedAttention),
                                    platform="cpu")
        jax.ffi.register_ffi_target("jserve_decoder_layers", jax.ffi.pycapsule(lib.JserveDecoderLayers),
                                    platform="cpu")
        jax.ffi.register_ffi_target("jserve_argmax", jax.ffi.pycapsule(lib.JserveArgmax), platform="cpu")
    except (OSError, AttributeError, KernelUnavailable) as error:
        return error if isinstance(error, KernelUnavailable) else KernelUnavailable(str(error))
    return lib


def packs_weights(dtype: str | jnp.dtype) -> bool:
    """Whether matmul weights of this dtype are packed once at load time (pack_weight), where the kernels then take
    every batch size: float32 and bfloat16 (as k-pairs: vdpbf16ps's operands with AVX512-BF16, split into floats by
    two bit operations elsewhere). Not with AMX, whose large batches go to XLA's dot on plain weights."""
    if not available() or "amx_bf16" in _cpu_flags():
        return False
    return jnp.dtype(dtype) in (jnp.bfloat16, jnp.float32)


def read_bandwidth(nbytes: int = 256 << 20, threads: int | None = None, repeats: int = 5) -> float:
    """Bytes/s this machine's memory is read at: every core (or `threads` threads) summing its share of an
    nbytes buffer on 2 MiB pages, best of `repeats` passes of plain loads and `repeats` with the weight stream's
    prefetches. A decode step that reads every weight once can go no faster (jserve bench latency's roofline)."""
    _require()
    lib = _load()
    lib.JserveReadBandwidth.restype = ctypes.c_double
    lib.JserveReadBandwidth.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    return lib.JserveReadBandwidth(nbytes, threads or len(os.sched_getaffinity(0)), repeats)


def cached_layer_calls() -> int:
    """How many decoder_layers calls in this process ran the phases their thread kept from its call before (the
    same buffers, shapes and attention items: a decode's step after step) instead of building them anew (layer_call.h's
    LayerCallCache)."""
    _require()
    lib = _load()
    lib.JserveCachedLayerCalls.restype = ctypes.c_int64
    lib.JserveCachedLayerCalls.argtypes = []
    return lib.JserveCachedLayerCalls()


def handed_calls() -> int:
    """How many kernel calls in this process handed their work to a helper thread still lingering from the call
    before, instead of waking one from the pool (phases.h's Lingerers)."""
    _require()
    lib = _load()
    lib.JserveHandedCalls.restype = ctypes.c_int64
    lib.JserveHandedCalls.argtypes = []
    return lib.JserveHandedCalls()


INT8_ACTIVATION_BLOCK = 32  # x values one scale covers where int8 matmuls quantize x (matmul_int8_vnni.h)


def int8_quantizes_activations() -> bool:
    """Whether this build's int8 matmuls quantize x too, at every row count, in blocks of INT8_ACTIVATION_BLOCK
    values along K (where K is a multiple), and multiply int8 by int8 (AVX512-VNNI's vpdpbusd); where not, they
    multiply the int8 weights by x as it is."""
    _require()
    lib = _load()
    lib.JserveInt8QuantizesActivations.restype = ctypes.c_int64
    lib.JserveInt8QuantizesActivations.argtypes = []
    return bool(lib.JserveInt8QuantizesActivations())


def int8_activation_reference(x: np.ndarray, q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """What the int8 matmul computes where it quantizes x (int8_quantizes_activations): float32 x [M, K] in blocks of 32
    (s = max|block| / 127, q_x = round-half-even(x * (1 / s))), the int8 dot of each block exact, times its s, summed
    over the blocks in order in float32, times the weight's row scale: NumPy's version, for tests."""
    m, k = x.shape
    blocks = x.reshape(m, k // INT8_ACTIVATION_BLOCK, INT8_ACTIVATION_BLOCK).astype(np.float32)
    s = (np.abs(blocks).max(-1) / np.float32(127)).astype(np.float32)
    inverse = np.where(s > 0, np.float32(1) / np.where(s > 0, s, np.float32(1)), np.float32(0)).astype(np.float32)
    xq = np.rint(blocks * inverse[..., None]).astype(np.int64)
    wq = q.reshape(q.shape[0], k // INT8_ACTIVATION_BLOCK, INT8_ACTIVATION_BLOCK).astype(np.int64)
    dots = np.einsum("mbk,nbk->mnb", xq, wq).astype(np.float32)  # exact: |dot| < 2^24
    out = np.zeros((m, q.shape[0]), np.float32)
    for b in range(k // INT8_ACTIVATION_BLOCK):
        out = (out + dots[:, :, b] * s[:, None, b]).astype(np.float32)
    return out * np.asarray(scale, np.float32)[None, :]


# The kinds of phase the profile tells apart (profile.h's PhaseKind): the layer kernel's steps ("inputs": a norm or
# the SiLU run as a phase of its own), and "other" for the other kernels' phases.
PHASE_KINDS = ("other", "qkv", "rotary", "attention", "merge", "o", "gate_up", "down", "inputs")
PROFILED_KERNELS = ("decoder_layers", "matmul", "argmax", "paged_attention")  # profile.h's KernelKind


class KernelCalls(NamedTuple):
    """One kernel's calls while profiled, on the calling thread's clock."""

    count: int
    seconds: float  # in the calls, all told
    before_phases_s: float  # of which before their phases began (checking arguments, planning the phases)
    after_phases_s: float  # and after their phases ended


class PhaseProfile(NamedTuple):
    """Time in the kernels since profiling was switched on. Worker 0 is the thread that called the kernel, the rest
    its helpers (phases.h's RunPhases); a worker's time between phases goes to the phase it just left."""

    busy_s: np.ndarray  # f64[workers, len(PHASE_KINDS)]: running items of each kind of phase
    wait_s: np.ndarray  # f64[workers, len(PHASE_KINDS)]: done with a phase, waiting for other threads' items of it
    calls: dict[str, KernelCalls]  # by kernel, for PROFILED_KERNELS


def profile_phases(enabled: bool) -> None:
    """Switch the kernels' phase profile on or off; either way its counts start again from zero. Off (the default),
    a call pays a load per thread that runs it and a null test a phase."""
    _require()
    lib = _load()
    lib.JserveProfileEnable.argtypes = [ctypes.c_int]
    lib.JserveProfileEnable(int(enabled))


def phase_profile() -> PhaseProfile:
    """What the profile has counted since profile_phases(True)."""
    _require()
    lib = _load()
    workers, kinds, kernels = ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int64()
    lib.JserveProfileShape.restype = ctypes.c_int64
    size = lib.JserveProfileShape(ctypes.byref(workers), ctypes.byref(kinds), ctypes.byref(kernels))
    assert (kinds.value, kernels.value) == (len(PHASE_KINDS), len(PROFILED_KERNELS)), "profile.h and this disagree"
    out = np.zeros(size, np.int64)
    lib.JserveProfileRead(out.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)))
    phases = workers.value * kinds.value
    busy, wait = (out[i * phases: (i + 1) * phases].reshape(workers.value, kinds.value) / 1e9 for i in range(2))
    counts, nanos, before, after = out[2 * phases:].reshape(4, kernels.value)
    used = max(1, int(np.flatnonzero((busy + wait).sum(axis=1)).max(initial=0)) + 1)  # workers that ever ran
    return PhaseProfile(busy[:used], wait[:used], {
        name: KernelCalls(int(counts[k]), float(nanos[k]) / 1e9, float(before[k]) / 1e9, float(after[k]) / 1e9)
        for k, name in enumerate(PROFILED_KERNELS)})


def max_kernel_rows() -> int:
    """The most rows of x a matmul sends to the kernel; larger batches use XLA's dot (docs/benchmarks.md)."""
    return AMX_KERNEL_ROWS if "amx_bf16" in _cpu_flags() else 1 << 62


def kernel_threads() -> int:
    """The threads the kernels run on: XLA's CPU thread pool has one per CPU this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def available() -> bool:
    """Whether the kernels are built and registered (builds them on the first call: a few seconds)."""
    return not isinstance(_load(), Exception)


def unavailable_reason() -> str | None:
    result = _load()
    return str(result) if isinstance(result, Exception) else None


def _require() -> None:
    result = _load()
    if isinstance(result, Exception):
        raise result


def matmul_ref(x: jax.Array, w: jax.Array) -> jax.Array:
    """x[..., K] @ w[N, K]^T -> float32[..., N] (XLA's dot); x is rounded to w's dtype first, as the kernel does."""
    return jax.lax.dot_general(x.astype(w.dtype), w, (((x.ndim - 1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


def matmul(x: jax.Array, w: jax.Array, out_features: int | None = None,
           compute_dtype: str | jnp.dtype | None = None) -> jax.Array:
    """x[..., K] @ w[N, K]^T -> float32[..., N]. w is float32 or bfloat16, or packed by pack_weight or
    pack_weight_int8 (then out_features gives N); for bfloat16 weights x is rounded to bfloat16 (as the XLA path's
    x.astype(w.dtype) does) and the products accumulate in float32. For int8 weights x is first rounded to
    compute_dtype where given (the XLA path's quantized_matmul does), and the result is the dequantized product."""
    _require()
    if is_packed(w) and w.dtype == jnp.int8:
        k, n = w.shape[1] - INT8_SCALE_ROWS, out_features
        if n is None or w.shape[0] * PACKED_ROWS != -(-n // PACKED_ROWS) * PACKED_ROWS:
            raise ValueError(f"matmul: a packed weight {w.shape} needs the out_features it was packed from, got {n}")
        if compute_dtype is not None:
            x = x.astype(compute_dtype)
    elif is_packed(w):
        k, n = (2 if w.dtype == jnp.uint32 else 1) * w.shape[1], out_features
        if n is None or w.shape[0] * PACKED_ROWS != -(-n // PACKED_ROWS) * PACKED_ROWS:
            raise ValueError(f"matmul: a packed weight {w.shape} needs the out_features it was packed from, got {n}")
    elif w.ndim == 2 and w.dtype in (jnp.float32, jnp.bfloat16):
        k, n = w.shape[1], w.shape[0]
    else:
        raise ValueError(f"matmul: a float32/bfloat16 w[N, K] (or a packed one) expected, got {w.shape} {w.dtype}")
    if x.shape[-1] != k:
        raise ValueError(f"matmul: x[..., {k}] expected for w {w.shape}, got {x.shape}")
    lead = x.shape[:-1]
    rows = x.reshape(-1, k).astype(jnp.float32)
    out = jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32)
    int8_round = w.dtype == jnp.int8 and compute_dtype is not None and jnp.dtype(compute_dtype) == jnp.bfloat16
    return jax.ffi.ffi_call("jserve_matmul", out)(rows, w, int8_round=np.int64(int8_round)).reshape(*lead, n)


def expert_matmul(x: jax.Array, w: jax.Array, expert: jax.Array, out_features: int,
                  compute_dtype: str | jnp.dtype | None = None) -> jax.Array:
    """matmul(x, w[expert], out_features, compute_dtype) for a stack of packed weights w[E, ...] and a traced expert
    index: the kernel reads the expert's blocks in place (an XLA slice of the stack would be copied out first)."""
    _require()
    if not is_packed_stack(w):
        raise ValueError(f"expert_matmul: a stack of packed weights [E, ...] expected, got {w.shape} {w.dtype}")
    k = w.shape[2] - INT8_SCALE_ROWS if w.dtype == jnp.int8 else (2 if w.dtype == jnp.uint32 else 1) * w.shape[2]
    if x.shape[-1] != k or w.shape[1] * PACKED_ROWS != -(-out_features // PACKED_ROWS) * PACKED_ROWS:
        raise ValueError(f"expert_matmul: x[..., {k}] and {out_features} outputs expected for w {w.shape}, got "
                         f"{x.shape}")
    if w.dtype == jnp.int8 and compute_dtype is not None:
        x = x.astype(compute_dtype)
    lead = x.shape[:-1]
    rows = x.reshape(-1, k).astype(jnp.float32)
    out = jax.ShapeDtypeStruct((rows.shape[0], out_features), jnp.float32)
    int8_round = w.dtype == jnp.int8 and compute_dtype is not None and jnp.dtype(compute_dtype) == jnp.bfloat16
    index = jnp.asarray(expert, jnp.int32).reshape(1)
    return jax.ffi.ffi_call("jserve_expert_matmul", out)(rows, w, index, int8_round=np.int64(int8_round)).reshape(
        *lead, out_features)


def argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax(x, axis=-1) of float32 x[S, V] -> int32[S]: the first index of each row's maximum, a NaN counting
    as the maximum. XLA CPU's argmax ran at ~1 ns an element (3.7 ms for 32 rows of a 49,152-token vocabulary)."""
    _require()
    if x.ndim != 2:
        raise ValueError(f"argmax: x[S, V] expected, got {x.shape}")
    out = jax.ShapeDtypeStruct((x.shape[0],), jnp.int32)
    return jax.ffi.ffi_call("jserve_argmax", out)(x.astype(jnp.float32))


def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                           query_start: jax.Array, seq_lens: jax.Array, *, scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           k_scales: jax.Array | None = None, v_scales: jax.Array | None = None,
                           sinks: jax.Array | None = None, attention_chunk: int | None = None) -> jax.Array:
    """The spec of pallas_kernels.interface.ragged_paged_attention; K/V float32, bfloat16, uint16 bf16 bits, or
    int8 with k_scales / v_scales (float32 [N, B, Hkv]: each (token, KV head) row's value = int8 * scale; the kernel
    widens and scales a row in registers as it reads it). Pages are read in place: only the pages each sequence
    uses, never a gathered copy. sinks (float32 [H], gpt-oss): query head h's softmax denominator gains
    exp(sinks[h]), added when a row is normalized."""
    _require()
    if (k_pages.dtype == jnp.int8) != (k_scales is not None) or (k_scales is None) != (v_scales is None):
        raise ValueError("ragged_paged_attention: int8 pages take k_scales and v_scales, other pages none")
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"ragged_paged_attention: sinks[{q.shape[1]}] (one per query head) expected, got "
                         f"{sinks.shape}")
    none = jnp.zeros((0,), jnp.float32)  # an absent scale or sink array
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call("jserve_paged_attention", out)(
        q.astype(jnp.float32), k_pages, v_pages, page_table.astype(jnp.int32), query_start.astype(jnp.int32),
        seq_lens.astype(jnp.int32), none if k_scales is None else k_scales, none if v_scales is None else v_scales,
        none if sinks is None else sinks.astype(jnp.float32), scale=np.float32(scale),
        sliding_window=np.int64(sliding_window or 0), soft_cap=np.float32(soft_cap or 0.0),
        attention_chunk=np.int64(attention_chunk or 0))


class PartLayout(NamedTuple):
    """Where every layer's four packed matrices (qkv, o, gate_up, down) lie in per-thread parts: one
    [parts, num_layers, layer_units] array, part p of layer l holding blocks [n p // parts, n (p + 1) // parts) of
    each matrix (n blocks of 32 rows), one matrix after another from its start. The layer kernel reads a few rows'
    matmuls as one part a thread, so each thread's share of a step is one forward stream through its own region
    (where the memory reads ~60 GB/s with both cores streaming, shared [layers, ...] stacks stream at 0.6-0.75 of it:
    docs/benchmarks.md). layer_args.h's MatrixParts reads the same layout."""

    parts: int
    begins: tuple[tuple[int, ...], ...]  # per matrix: the block each part starts at, [parts + 1]
    offsets: tuple[tuple[int, ...], ...]  # per part, per matrix: its first 4-byte unit in the part's layer region
    block_units: tuple[int, ...]  # per matrix: units a packed block (4-byte units; int8: bytes)
    layer_units: int  # the largest part's units a layer (the others are padded to it)
    dtype: np.dtype  # uint32 (bfloat16 pairs) or float32, as pack_weight packs; int8 as pack_weight_int8 does


def part_layout(shapes: Sequence[tuple[int, int]], dtype: str | jnp.dtype, parts: int) -> PartLayout:
    """The PartLayout of matrices of these [N, K] shapes (qkv, o, gate_up, down) in `dtype` (int8: packed with their
    scales, pack_weight_int8), in `parts` parts."""
    bf16, int8 = jnp.dtype(dtype) == jnp.bfloat16, jnp.dtype(dtype) == jnp.int8
    if parts < 1 or len(shapes) != 4 or (bf16 and any(k % 2 for _, k in shapes)):
        raise ValueError(f"part_layout: 4 matrix shapes (K even in bfloat16) and parts >= 1, got {shapes}, {parts}")
    blocks = [-(-n // PACKED_ROWS) for n, _ in shapes]
    block_units = tuple(PACKED_ROWS * (k + INT8_SCALE_ROWS if int8 else k // 2 if bf16 else k) for _, k in shapes)
    begins = tuple(tuple(b * p // parts for p in range(parts + 1)) for b in blocks)
    offsets = []
    for p in range(parts):
        sizes = [(begin[p + 1] - begin[p]) * units for begin, units in zip(begins, block_units, strict=True)]
        offsets.append(tuple(int(o) for o in np.cumsum([0, *sizes])))
    layer_units = max(o[-1] for o in offsets)
    return PartLayout(parts, begins, tuple(o[:-1] for o in offsets), block_units, layer_units,
                      np.dtype(np.int8 if int8 else np.uint32 if bf16 else np.float32))


def place_in_parts(regions: np.ndarray, layout: PartLayout, layer: int, matrix: int, packed: np.ndarray) -> None:
    """Writes layer `layer`'s packed matrix number `matrix` (0 qkv, 1 o, 2 gate_up, 3 down) into its parts."""
    begins, units = layout.begins[matrix], layout.block_units[matrix]
    if packed.dtype != layout.dtype or packed.shape[0] != begins[-1] or packed[0].size != units:
        raise ValueError(f"place_in_parts: matrix {matrix} should be {begins[-1]} packed blocks of {units} "
                         f"{layout.dtype}, got {packed.shape} {packed.dtype}")
    for p in range(layout.parts):
        start = layout.offsets[p][matrix]
        part = packed[begins[p]: begins[p + 1]].reshape(-1)
        regions[p, layer, start: start + part.size] = part


_ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # the layer kernel's activation attribute


class LayerWeights(NamedTuple):
    """One decoder layer's parameters as `decoder_layers` takes them; biases and q/k norms may be None. Stacked, the
    four matrices may instead lie in per-thread parts (`matrix_parts`, see PartLayout; qkv, o, gate_up and down are
    then None)."""

    input_norm: jax.Array  # f32[E]
    qkv: jax.Array | None  # [Q + 2 KV, E] float32 or bfloat16 (or all four packed by pack_weight): q, k, v rows
    o: jax.Array | None  # [E, Q]
    post_norm: jax.Array  # f32[E]
    gate_up: jax.Array | None  # [2 I, E]: gate rows, then up rows
    down: jax.Array | None  # [E, I]
    qkv_bias: jax.Array | None = None  # f32[Q + 2 KV]
    o_bias: jax.Array | None = None  # f32[E]
    gate_up_bias: jax.Array | None = None  # f32[2 I]
    down_bias: jax.Array | None = None  # f32[E]
    q_norm: jax.Array | None = None  # f32[D] (Qwen3: RMSNorm of each head before rotary)
    k_norm: jax.Array | None = None  # f32[D]
    # Gemma 2/3's sandwich norms: the attention and MLP outputs are normalized before the residual add
    attn_out_norm: jax.Array | None = None  # f32[E]
    mlp_out_norm: jax.Array | None = None  # f32[E]
    matrix_parts: jax.Array | None = None  # [parts, L, layer_units] uint32 or float32 (PartLayout): stacked only


def decoder_layers(x: jax.Array, layers: Sequence[LayerWeights] | LayerWeights,
                   k_pages: Sequence[jax.Array] | jax.Array, v_pages: Sequence[jax.Array] | jax.Array, *,
                   positions: jax.Array, slot_mapping: jax.Array, page_table: jax.Array, query_start: jax.Array,
                   seq_lens: jax.Array, inv_freq: np.ndarray, num_heads: int, eps: float, scale: float,
                   sliding_window: int | None = None, soft_cap: float | None = None,
                   intermediate_size: int | None = None, k_scales: Sequence[jax.Array] | jax.Array | None = None,
                   v_scales: Sequence[jax.Array] | jax.Array | None = None,
                   compute_dtype: str | jnp.dtype = jnp.float32, activation: str = "silu") -> tuple:
    """Llama-family decoder layers, one after another, over a ragged batch in one kernel call
    -> (x_out, k_pages, v_pages), the pages in the form given: a list per layer, or stacked, one
    [L, num_pages, page_size, num_kv_heads, head_dim] array each.

    `layers` is a LayerWeights per layer, or one whose arrays are stacked, layer first (the loader's stacks,
    checkpoints.host_arena.LayerStacks: a jitted step pays its dispatch per array argument, and stacked weights and
    pages are 16 arrays whatever the depth).
    x f32[T, E] is the residual stream; each layer's new K/V are written to their slots (out of range: dropped) and
    the pages come back updated in place (aliased: inside a jitted step with a donated cache nothing is copied).
    The batch arrays follow pallas_kernels.interface; every layer's matmul weights are all float32, all bfloat16, or
    all packed by pack_weight, with the same shapes in every layer; stacked, they may lie in per-thread parts
    (LayerWeights.matrix_parts), which need `intermediate_size`.
    int8 pages come with k_scales and v_scales in the same form (float32, the pages' shape without head_dim: one
    scale per (token, KV head) row); each new row is quantized as it is written (max|row| / 127) and read widened and
    scaled in registers. Then the result is (x_out, k_pages, v_pages, k_scales, v_scales).
    int8 matmul weights (packed by pack_weight_int8, their scales inside) take their inputs rounded to compute_dtype
    (bfloat16 in a bfloat16 model, as the XLA path's quantized_matmul rounds them).
    activation: the MLP's, "silu" or "gelu_pytorch_tanh" (GELU's tanh approximation, Gemma's)."""
    _require()
    if activation not in _ACTIVATIONS:
        raise ValueError(f"decoder_layers: activation must be one of {list(_ACTIVATIONS)}, got {activation!r}")
    stacked_weights = isinstance(layers, LayerWeights)
    in_parts = stacked_weights and layers.matrix_parts is not None
    if in_parts and (intermediate_size is None or any(w is not None for w in layers[1:3] + layers[4:6])):
        raise ValueError("decoder_layers: weights in per-thread parts need intermediate_size, and no other matrices")
    if in_parts:
        parts = layers.matrix_parts
        none = jnp.zeros((0,), parts.dtype)
        layers = layers._replace(qkv=parts, o=none, gate_up=none, down=none, matrix_parts=None)
    num_layers = layers.input_norm.shape[0] if stacked_weights else len(layers)
    stacked = isinstance(k_pages, jax.Array | np.ndarray)
    kv_arrays = [k_pages, v_pages] if stacked else [*k_pages, *v_pages]
    int8 = (k_pages if stacked else k_pages[0]).dtype == jnp.int8
    if int8 != (k_scales is not None) or (k_scales is None) != (v_scales is None):
        raise ValueError("decoder_layers: int8 pages take k_scales and v_scales, other pages none")
    if int8:
        kv_arrays += [k_scales, v_scales] if stacked else [*k_scales, *v_scales]
    num_kv = k_pages.shape[0] if stacked and k_pages.ndim == 5 else (-1 if stacked else len(k_pages))
    if num_layers == 0 or num_kv != num_layers or stacked != isinstance(v_pages, jax.Array | np.ndarray) or \
            (not stacked and len(v_pages) != num_layers) or (stacked and v_pages.shape != k_pages.shape):
        shape = lambda pages: pages.shape if isinstance(pages, jax.Array | np.ndarray) else f"{len(pages)} arrays"
        raise ValueError(f"decoder_layers: {num_layers} layers need as many k_pages and v_pages (a list each, or one "
                         f"[{num_layers}, N, B, Hkv, D] array each), got {shape(k_pages)} and {shape(v_pages)}")
    if stacked_weights:
        matrix_fields = (1, 2, 4, 5)  # in parts: the parts, then three empty arrays
        present = [w for i, w in enumerate(layers) if w is not None and not (in_parts and i in matrix_fields)]
        if layers.input_norm.ndim != 2 or any(w.shape[0] != num_layers for w in present):
            raise ValueError(f"decoder_layers: stacked weights must all be [{num_layers}, ...], got "
                             f"{[w.shape for w in present]}")
    dtype = (layers if stacked_weights else layers[0]).qkv.dtype
    for weights in [layers] if stacked_weights else layers:
        matmuls = (weights.qkv, weights.o, weights.gate_up, weights.down)
        if any(w.dtype != dtype for w in matmuls) or dtype not in (jnp.float32, jnp.bfloat16, jnp.uint32, jnp.int8):
            raise ValueError(f"decoder_layers: the matmul weights must all be float32, bfloat16 or packed, got "
                             f"{[w.dtype for w in matmuls]}")
    none = jnp.zeros((0,), jnp.float32)

    def f32(a: jax.Array | None) -> jax.Array:
        return none if a is None else a.astype(jnp.float32)

    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    args = [x.astype(jnp.float32), i32(positions), i32(slot_mapping), i32(page_table), i32(query_start),
            i32(seq_lens), jnp.asarray(inv_freq, jnp.float32)]
    for w in [layers] if stacked_weights else layers:  # the order layer_args.h's LayerBuffersAt reads
        args += [f32(w.input_norm), w.qkv, f32(w.qkv_bias), f32(w.q_norm), f32(w.k_norm), w.o, f32(w.o_bias),
                 f32(w.post_norm), w.gate_up, f32(w.gate_up_bias), w.down, f32(w.down_bias), f32(w.attn_out_norm),
                 f32(w.mlp_out_norm)]
    kv_in = len(args)
    args += kv_arrays
    out = [jax.ShapeDtypeStruct(x.shape, jnp.float32)]
    out += [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in kv_arrays]
    aliases = {kv_in + i: 1 + i for i in range(len(kv_arrays))}
    x_out, *pages = jax.ffi.ffi_call("jserve_decoder_layers", out, input_output_aliases=aliases)(
        *args, num_heads=np.int64(num_heads), eps=np.float32(eps), scale=np.float32(scale),
        sliding_window=np.int64(sliding_window or 0), soft_cap=np.float32(soft_cap or 0.0),
        weight_parts=np.int64(layers.qkv.shape[0] if in_parts else 0),
        intermediate_size=np.int64(intermediate_size if in_parts else 0),
        int8_round=np.int64(dtype == jnp.int8 and jnp.dtype(compute_dtype) == jnp.bfloat16),
        activation=np.int64(_ACTIVATIONS[activation]))
    n = 1 if stacked else num_layers
    groups = [pages[i * n] if stacked else pages[i * n: (i + 1) * n] for i in range(len(pages) // n)]
    return (x_out, *groups)
