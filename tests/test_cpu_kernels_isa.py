"""Every ISA branch the CPU kernels keep, built with explicit -m flags instead of -march=native: AVX2 + FMA,
AVX-512, AVX512-BF16, and AVX512-BF16 with JSERVE_INTEL (the Intel prefetches and widened bfloat16 tiles).

Every variant must compile, so that no branch rots unseen on machines that never build it. Each variant this CPU
can execute is loaded in a subprocess (JSERVE_CPU_KERNELS_LIB) that runs the kernels on inputs made here: matmuls
on plain and packed weights at every tile height, paged attention, argmax, and the decoder layers through the
engine. Here they are checked against the references test_cpu_kernels.py uses: the matmul against NumPy in float64,
attention against the pure-JAX reference, and the engine against its reference backend (the model's own layers).

The variants build at -O1 (~5 s each, against ~10 at -O3), two at a time, and each one's subprocess (~8 s) starts
as soon as its build is done, while this process makes the references: ~100 CPU-seconds, ~56 s on two idle cores."""

from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels

ISA_FLAGS = {
    "avx2": ("-mavx2", "-mfma"),
    "avx512": ("-mavx2", "-mfma", "-mavx512f", "-mavx512cd", "-mavx512bw", "-mavx512dq", "-mavx512vl"),
    "avx512bf16": ("-mavx2", "-mfma", "-mavx512f", "-mavx512cd", "-mavx512bw", "-mavx512dq", "-mavx512vl",
                   "-mavx512bf16"),
}
# JSERVE_INTEL's prefetch branches are the same code under every ISA; its widened bfloat16 tiles are AVX512-BF16's:
# one Intel build, the widest, compiles them all.
VARIANTS = {**{isa: flags for isa, flags in ISA_FLAGS.items()},
            "avx512bf16-intel": (*ISA_FLAGS["avx512bf16"], "-DJSERVE_INTEL")}
CPUINFO = {"-mavx512bf16": "avx512_bf16"}  # /proc/cpuinfo's name for an -m flag's extension, where not the same
OPTIMIZATION = "-O1"  # the same code paths as -O3 takes, built in ~5 s instead of ~10

# (rows, in_features, out_features, dtype, packed): the plain path's row kernels (1-7 rows) and panel tiles (8+
# rows, 12+ for bfloat16 with AVX512-BF16), and the packed path's row blocks (1-4), wide and pair tiles (1-8) and
# widened or 12-row tiles past them; widths off the 8- and 16-lane vectors and the 32-column blocks.
MATMULS = [(rows, k, n, dtype, packed)
           for dtype in ("float32", "bfloat16")
           for packed, shapes in ((False, [(1, 130, 70), (3, 33, 7), (4, 96, 40), (7, 70, 33), (8, 96, 40),
                                            (12, 100, 64), (13, 130, 70), (32, 96, 40), (100, 200, 129)]),
                                  (True, [(1, 130, 70), (2, 64, 100), (3, 34, 7), (4, 576, 100), (5, 576, 33),
                                          (8, 576, 96), (9, 130, 70), (12, 100, 64), (13, 576, 100),
                                          (32, 576, 100), (100, 200, 129)]))
           for rows, k, n in shapes]
INVARIANT_ROWS = 9  # packed, with AVX-512 row blocks: a row's bits alike in a batch of 1-4 rows and of 9 (tiles)
# (seqs, heads, kv_heads, head_dim, page_size, dtype, extra): the bfloat16 register paths (head_dim 64 and 128, 2-4
# query heads a KV head on AVX2), the widened rows (head_dim 40, prefill rows), float32 rows, long decodes split in
# parts with a window and a soft cap.
ATTENTION = [
    ([(1, 40), (12, 12), (20, 52), (1, 32), (3, 17), (9, 140)], 9, 3, 64, 16, "bfloat16", {}),
    ([(1, 150), (1, 33), (2, 47)], 4, 2, 128, 16, "bfloat16", {}),
    ([(1, 40), (5, 60), (1, 90)], 8, 2, 40, 32, "bfloat16", {"soft_cap": 30.0}),
    ([(1, 40), (12, 12), (20, 52), (1, 150)], 9, 3, 64, 16, "float32", {}),
    ([(1, 600), (1, 257), (5, 400)], 9, 3, 64, 16, "float32", {"sliding_window": 300, "soft_cap": 20.0}),
    ([(1, 600), (1, 17), (1, 300)], 6, 2, 64, 16, "bfloat16", {}),
]
ATTENTION_ARGS = ("q", "k_pages", "v_pages", "page_table", "query_start", "seq_lens")
# The engine's prompts: a 130-token prefill in two chunks, shorter ones, then decodes of all three at once.
PROMPTS = [[3 + (7 * i + s) % 500 for i in range(n)] for s, n in enumerate((40, 7, 130))]
DECODE_STEPS = 6


def _cpu_lacks(variant: str) -> set[str]:
    """The /proc/cpuinfo flags a variant's -m flags need that this CPU lacks."""
    needs = {CPUINFO.get(flag, flag[2:]) for flag in VARIANTS[variant] if flag.startswith("-m")}
    return needs - cpu_kernels._cpu_flags()


def _as(values: np.ndarray, dtype: str) -> np.ndarray:
    return values.astype(jnp.dtype(dtype))  # bfloat16 inputs are saved as their (exact) float32 values


def _attention_args(data: dict[str, np.ndarray], i: int) -> list[jax.Array]:
    dtype = ATTENTION[i][5]
    return [jnp.asarray(_as(data[f"attention{i}_{name}"], dtype) if name in ATTENTION_ARGS[:3] else
                        data[f"attention{i}_{name}"]) for name in ATTENTION_ARGS]


def _generate(model_dir: str, dtype: str, attention_backend: str) -> dict[str, np.ndarray]:
    """The engine's greedy tokens and their logprobs, and every prompt token's logprob, for PROMPTS."""
    from jserve import LLM, SamplingParams

    llm = LLM(model_dir, dtype=dtype, attention_backend=attention_backend, max_model_len=512,
              kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=128, max_num_seqs=8, warmup=False,
              compilation_cache_dir="")
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    result = {}
    for i, (prompt, out) in enumerate(zip(PROMPTS, outputs, strict=True)):
        tokens = out.outputs[0].token_ids
        result[f"tokens{i}"] = np.asarray(tokens)
        result[f"logprobs{i}"] = np.asarray([lp[t] for t, lp in zip(tokens, out.outputs[0].logprobs, strict=True)])
        result[f"prompt{i}"] = np.asarray([lp[t] for t, lp in zip(prompt[1:], out.prompt_logprobs[1:], strict=True)])
    return result


def run_variant(inputs: str, out: str, model_dir: str) -> None:
    """Runs in the subprocess, JSERVE_CPU_KERNELS_LIB naming one variant: every kernel on `inputs`, into `out`."""
    assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
    cpu_kernels.profile_phases(True)  # to see that the engine runs the decoder layer kernel
    data = dict(np.load(inputs))
    results = {}

    def matmuls(xs, ws):
        outs = []
        for (rows, _, n, _, packed), x, w in zip(MATMULS, xs, ws, strict=True):
            outs.append(cpu_kernels.matmul(x, w, n if packed else None))
            if packed and rows == INVARIANT_ROWS:
                outs += [cpu_kernels.matmul(x[rows - r:], w, n) for r in (1, 2, 3, 4)]
        return outs

    xs, ws = [], []
    for i, (_, _, _, dtype, packed) in enumerate(MATMULS):
        w = _as(data[f"w{i}"], dtype)
        xs.append(jnp.asarray(data[f"x{i}"]))
        ws.append(jnp.asarray(cpu_kernels.pack_weight(w) if packed else w))
    for i, y in enumerate(jax.jit(matmuls)(xs, ws)):  # one compile for every call
        results[f"matmul{i}"] = np.asarray(y)

    def attention(cases):
        return [cpu_kernels.ragged_paged_attention(*args, scale=case[3] ** -0.5, **case[6])
                for case, args in zip(ATTENTION, cases, strict=True)]

    cases = [_attention_args(data, i) for i in range(len(ATTENTION))]
    for i, y in enumerate(jax.jit(attention)(cases)):
        results[f"attention{i}"] = np.asarray(y)
    results["argmax"] = np.asarray(jax.jit(cpu_kernels.argmax)(jnp.asarray(data["logits"])))
    for dtype in ("float32", "bfloat16"):
        results.update({f"{dtype}_{k}": v for k, v in _generate(model_dir, dtype, "auto").items()})
    results["layer_calls"] = np.asarray(cpu_kernels.phase_profile().calls["decoder_layers"].count)
    np.savez(out, **results)


def _inputs() -> dict[str, np.ndarray]:
    from test_kernels import make_batch

    rng = np.random.default_rng(31)
    data = {}
    for i, (rows, k, n, dtype, _) in enumerate(MATMULS):
        data[f"x{i}"] = rng.standard_normal((rows, k)).astype(np.float32)
        data[f"w{i}"] = _as(rng.standard_normal((n, k)), dtype).astype(np.float32)
    for i, (seqs, heads, kv_heads, head_dim, page_size, dtype, _) in enumerate(ATTENTION):
        args, meta = make_batch(rng, seqs, heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
                                dtype=dtype)
        for name, a in zip(ATTENTION_ARGS, args, strict=True):
            data[f"attention{i}_{name}"] = np.asarray(a.astype(jnp.float32) if name in ATTENTION_ARGS[:3] else a)
        data[f"attention{i}_token_seq"], data[f"attention{i}_positions"], data[f"attention{i}_real"] = meta
    logits = rng.standard_normal((5, 1037)).astype(np.float32)
    logits[1, [5, 900]] = 50.0  # a tie: the first wins
    logits[2, [17, 400]] = np.nan  # the first NaN wins
    logits[3] = -np.inf
    data["logits"] = logits
    return data


def _references(data: dict[str, np.ndarray], model_dir: Path) -> dict[str, np.ndarray]:
    from pallas_kernels import ragged_paged_attention_ref

    refs = {}
    for i, (_, _, _, dtype, _) in enumerate(MATMULS):
        x = _as(data[f"x{i}"], dtype).astype(np.float64)  # rounded to the weight's dtype, as the kernel does
        refs[f"matmul{i}"] = x @ data[f"w{i}"].astype(np.float64).T

    def attention(cases):
        return [ragged_paged_attention_ref(q, k, v, table, seq, pos, scale=case[3] ** -0.5, **case[6])
                for case, (q, k, v, table, seq, pos) in zip(ATTENTION, cases, strict=True)]

    cases = [[*_attention_args(data, i)[:4], jnp.asarray(data[f"attention{i}_token_seq"]),
              jnp.asarray(data[f"attention{i}_positions"])] for i in range(len(ATTENTION))]
    for i, ref in enumerate(jax.jit(attention)(cases)):  # one compile for every case
        refs[f"attention{i}"] = np.asarray(ref)[: data[f"attention{i}_real"]]
    refs["argmax"] = np.argmax(data["logits"], axis=-1)
    for dtype in ("float32", "bfloat16"):
        refs.update({f"{dtype}_{k}": v for k, v in _generate(str(model_dir), dtype, "reference").items()})
    return refs


def _build_and_run(variant: str, build, out: Path, inputs: Path, model_dir: Path) -> dict:
    """Builds the variant (with the session's kernel_build), then, where this CPU can execute it, runs its kernels
    in a subprocess that writes `out`."""
    start = time.perf_counter()
    try:
        lib = build((OPTIMIZATION, *VARIANTS[variant], *cpu_kernels.LIBRARY_FLAGS))
        result = {"build_error": None}
    except cpu_kernels.KernelUnavailable as error:
        result = {"build_error": str(error)}
    result["build_s"] = time.perf_counter() - start
    if result["build_error"] is not None or _cpu_lacks(variant):
        return result
    env = dict(os.environ, JAX_PLATFORMS="cpu", **{cpu_kernels.LIBRARY_ENV: str(lib)})
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), str(Path(cpu_kernels.__file__).parents[1]),
                                         env.get("PYTHONPATH", "")])
    code = f"import test_cpu_kernels_isa as t; t.run_variant({str(inputs)!r}, {str(out)!r}, {str(model_dir)!r})"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    result.update(run_s=time.perf_counter() - start, returncode=proc.returncode, log=proc.stderr[-4000:],
                  outputs=dict(np.load(out)) if proc.returncode == 0 else None)
    return result


@pytest.fixture(scope="module")
def variants(tmp_path_factory, hf_model_dir, kernel_build) -> tuple[dict[str, concurrent.futures.Future], dict]:
    """Each variant's build and run (futures, two at a time, all started here), and the references, made meanwhile:
    one build of each variant for the module."""
    if not cpu_kernels.available():
        pytest.skip(cpu_kernels.unavailable_reason())
    work = tmp_path_factory.mktemp("isa")
    model_dir = hf_model_dir("llama")
    data = _inputs()
    np.savez(work / "inputs.npz", **data)
    pool = concurrent.futures.ThreadPoolExecutor(2)
    runs = {v: pool.submit(_build_and_run, v, kernel_build, work / f"{v}.npz", work / "inputs.npz", model_dir)
            for v in VARIANTS}
    pool.shutdown(wait=False)
    return runs, _references(data, model_dir)


def test_every_included_file_is_in_the_build_key():
    """The build is cached by a hash of cpu_kernels.sources(): every file kernels.cc includes, directly or not."""
    sources = {p.name for p in cpu_kernels.sources()}
    for path in cpu_kernels.sources():
        for name in re.findall(r'^#include "([^"]+)"', path.read_text(), re.MULTILINE):
            assert name.startswith("xla/") or name in sources, f"{path.name} includes {name}, not in sources()"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_builds_and_runs_the_kernels(variants, variant):
    runs, refs = variants
    run = runs[variant].result()
    assert run["build_error"] is None, run["build_error"]
    print(f"{variant}: built in {run['build_s']:.1f} s", end="")
    if lacks := _cpu_lacks(variant):
        pytest.skip(f"built; this CPU lacks {sorted(lacks)} to run it")
    print(f", ran in {run['run_s']:.1f} s")
    assert run["returncode"] == 0, run["log"]
    got = run["outputs"]
    index = 0
    for i, (rows, k, n, dtype, packed) in enumerate(MATMULS):
        y = got[f"matmul{index}"]
        np.testing.assert_allclose(y, refs[f"matmul{i}"], rtol=1e-5, atol=1e-5 * np.sqrt(k),
                                   err_msg=f"matmul {(rows, k, n, dtype, packed)}")
        index += 1
        if packed and rows == INVARIANT_ROWS:  # row blocks only where AVX-512 (and for bfloat16, -BF16) has them
            row_blocks = variant.startswith("avx512bf16") or (variant.startswith("avx512") and dtype == "float32")
            for r in (1, 2, 3, 4):
                if row_blocks:
                    np.testing.assert_array_equal(got[f"matmul{index}"], y[rows - r:], err_msg=f"{dtype} {r} rows")
                index += 1
    for i, case in enumerate(ATTENTION):
        out, ref = got[f"attention{i}"], refs[f"attention{i}"]
        assert np.all(out[len(ref):] == 0), f"attention {case}: padding tokens must come out as zeros"
        error = np.abs(out[: len(ref)] - ref).max()
        assert error <= (1e-5 if case[5] == "float32" else 2e-2), f"attention {case}: max abs error {error:.3g}"
    np.testing.assert_array_equal(got["argmax"], refs["argmax"])
    assert got["layer_calls"] > 0  # the engine ran the decoder layer kernel
    for dtype, atol in (("float32", 1e-4), ("bfloat16", 5e-2)):
        for i in range(len(PROMPTS)):
            key = f"{dtype}_{{}}{i}"
            np.testing.assert_allclose(got[key.format("prompt")], refs[key.format("prompt")], atol=atol, rtol=0,
                                       err_msg=f"{dtype} prompt {i}: prompt logprobs")
            alike = np.cumprod(got[key.format("tokens")] == refs[key.format("tokens")]).sum()  # steps alike so far
            assert dtype == "bfloat16" or alike == DECODE_STEPS, f"{dtype} prompt {i}: greedy tokens differ"
            np.testing.assert_allclose(got[key.format("logprobs")][:alike], refs[key.format("logprobs")][:alike],
                                       atol=atol, rtol=0, err_msg=f"{dtype} prompt {i}: decode logprobs")
