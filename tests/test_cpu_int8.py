"""int8 weights on the C++ CPU layer kernels: the packed int8 matmul against NumPy's dequantize-then-matmul, the
cpu-layers executor's int8 logits and greedy tokens against the XLA executor's, stored int8 checkpoints
(compressed-tensors W8A16, an int8 Orbax conversion) served on cpu-layers, tensor parallelism (the executor's XLA
fallback), and the executor choice."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_quantization import _compressed_tensors_checkpoint

import cpu_kernels
from jserve.convert import convert
from jserve.engine.sequence import ScheduledSeq, Sequence
from jserve.executors import CpuLayerExecutor, XlaExecutor, choose_executor
from jserve.executors.cpu_layers import CpuLoadedModel
from jserve.loading import load_model
from jserve.models.quantization import dequantize_rows, quantize_rows
from jserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the C++ kernels are unavailable here")

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["the quick brown fox", "one two three four five six", "hello"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17])
@pytest.mark.parametrize("compute", [None, "bfloat16"])
def test_int8_matmul_matches_numpy_dequantize_then_matmul(rows, compute):
    """Odd N (a partial last block of 32 rows) and K (no multiple of the 4-k unroll or the 8-lane vectors)."""
    rng = np.random.default_rng(rows)
    for n, k in ((37, 13), (70, 131), (33, 5), (96, 64)):
        q, scale = quantize_rows(rng.normal(0, 0.1, (n, k)).astype(np.float32))
        x = rng.normal(0, 1, (rows, k)).astype(np.float32)
        packed = cpu_kernels.pack_weight_int8(q, scale)
        assert packed.shape == (-(-n // 32), k + 4, 32) and packed.dtype == np.int8
        got = np.asarray(jax.jit(lambda x, w, n=n: cpu_kernels.matmul(x, w, n, compute))(x, packed))
        xr = np.asarray(jnp.asarray(x).astype(compute).astype(jnp.float32)) if compute else x
        want = xr @ dequantize_rows(q, scale).T
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max(), err_msg=f"{n}x{k}")
    with pytest.raises(ValueError, match="int8 \\[N, K\\] weight"):
        cpu_kernels.pack_weight_int8(q.astype(np.int16), scale)


def _executor(cls, model, dtype: str, tokens: int = 64):
    return cls(model, dtype=dtype, num_blocks=32, block_size=16, max_num_batched_tokens=tokens, max_num_seqs=4,
               max_model_len=128)


def _logits(runner) -> np.ndarray:
    """All-position logits of a 21-token prompt and a 3-token one (one prefill step: 24 rows), then two decode steps
    of both (2 rows), then one of the first alone (1 row)."""
    rng = np.random.default_rng(2)
    seqs = [Sequence("a", rng.integers(3, 500, 21).tolist(), SamplingParams()),
            Sequence("b", rng.integers(3, 500, 3).tolist(), SamplingParams())]
    seqs[0].block_table, seqs[1].block_table = [3, 0], [5]
    out = [np.asarray(runner.run(runner.prepare([ScheduledSeq(s, s.num_tokens, True) for s in seqs],
                                                all_logits=True)))[:24]]
    for s in seqs:
        s.num_computed_tokens = s.num_tokens
    for step in range(3):
        live = seqs if step < 2 else seqs[:1]
        for s in live:
            s.append_token(7 + step)
        out.append(np.asarray(runner.run(runner.prepare([ScheduledSeq(s, 1, False) for s in live])))[:len(live)])
        for s in live:
            s.num_computed_tokens = s.num_tokens
    return np.concatenate(out)


@pytest.mark.parametrize("weight_parts", [None, 0])  # per-thread parts, or [layers, ...] stacks
def test_cpu_layers_int8_logits_match_xla(hf_model_dir, weight_parts):
    model_dir = hf_model_dir("llama", hidden_size=96, intermediate_size=352)
    cpu = CpuLayerExecutor.load(model_dir, dtype="float32", quantization="int8", weight_parts=weight_parts)
    assert isinstance(cpu, CpuLoadedModel) and cpu.quantization == "int8" and cpu.layer_stack is not None
    matrices = cpu.layer_stack.matrix_parts if weight_parts is None else cpu.layer_stack.qkv
    assert matrices.dtype == jnp.int8  # packed int8 with the scales inside: no float copy anywhere
    xla = load_model(model_dir, "float32", quantization="int8")
    got, want = _logits(_executor(CpuLayerExecutor, cpu, "float32")), _logits(_executor(XlaExecutor, xla, "float32"))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_cpu_layers_int8_serves_like_xla(hf_model_dir, llm_factory):
    """bfloat16 end to end: greedy tokens on cpu-layers (x rounded to bfloat16 before each int8 matmul, as the XLA
    path's quantized_matmul does) against the XLA executor's, and a batch of more rows than a decode's."""
    model_dir = hf_model_dir("llama")
    cpu = llm_factory(model_dir, dtype="bfloat16", quantization="int8", executor="cpu-layers")
    xla = llm_factory(model_dir, dtype="bfloat16", quantization="int8", executor="xla")
    assert cpu.engine.executor.name == "cpu-layers" and cpu.engine.executor.every_step_fused
    got = [o.outputs[0].token_ids for o in cpu.generate(PROMPTS, GREEDY, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in xla.generate(PROMPTS, GREEDY, use_tqdm=False)]
    agree = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    assert agree >= 0.9 * sum(map(len, want)), (got, want)


@pytest.mark.parametrize("fmt", ["int-quantized", "pack-quantized"])
def test_compressed_tensors_checkpoint_serves_on_cpu_layers(hf_model_dir, llm_factory, tmp_path, fmt):
    src = hf_model_dir("llama", intermediate_size=130)  # K = 130 in down_proj: no multiple of the 4-k unroll
    ckpt = _compressed_tensors_checkpoint(src, tmp_path / "ct", fmt)
    cpu = llm_factory(ckpt, executor="auto")  # stored int8: the C++ layer kernels serve it
    assert cpu.engine.executor.name == "cpu-layers" and cpu.engine.quantization == "int8"
    xla = llm_factory(ckpt, executor="xla")
    assert ([o.outputs[0].token_ids for o in cpu.generate(PROMPTS, GREEDY, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in xla.generate(PROMPTS, GREEDY, use_tqdm=False)])


def test_int8_orbax_conversion_serves_on_cpu_layers(hf_model_dir, llm_factory, tmp_path):
    out = convert(str(hf_model_dir("llama")), tmp_path / "int8", "float32", "int8")
    loaded = CpuLayerExecutor.load(out, dtype="float32")  # the stored weights and scales, paired and packed
    assert loaded.quantization == "int8" and loaded.layer_stack.matrix_parts.dtype == jnp.int8
    want = _logits(_executor(XlaExecutor, load_model(out, "float32"), "float32"))
    np.testing.assert_allclose(_logits(_executor(CpuLayerExecutor, loaded, "float32")), want, rtol=1e-4, atol=1e-4)
    cpu = llm_factory(out, executor="cpu-layers")
    xla = llm_factory(out, executor="xla")
    assert ([o.outputs[0].token_ids for o in cpu.generate(PROMPTS, GREEDY, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in xla.generate(PROMPTS, GREEDY, use_tqdm=False)])


def test_executor_choice_for_quantized_weights(hf_model_dir):
    cls, attention, why = choose_executor("auto", "auto", platform="cpu", quantization="int8")
    assert cls is CpuLayerExecutor and attention == "cpu"
    assert choose_executor("cpu-layers", "auto", platform="cpu", quantization="int8")[0] is CpuLayerExecutor
    assert choose_executor("auto", "auto", platform="cpu", quantization="int8", sharded=True)[0] is XlaExecutor
    with pytest.raises(ValueError, match="fp8 weights need a GPU.*use int8"):
        choose_executor("cpu-layers", "auto", platform="cpu", quantization="fp8")
    with pytest.raises(ValueError, match="executor 'cpu-layers' has no fp8 matmul kernels"):
        CpuLayerExecutor.load(hf_model_dir("llama"), dtype="float32", quantization="fp8")


# (rows, K, N) for the AVX2 build: the streamed rows (1-4: two at a time there) and the widened panels past them.
AVX2_MATMULS = [(1, 130, 70), (2, 64, 100), (3, 34, 7), (4, 576, 100), (5, 13, 33), (17, 576, 96), (40, 131, 70)]


def run_avx2(inputs: str, out: str, model_dir: str) -> None:
    """Runs in the subprocess, JSERVE_CPU_KERNELS_LIB naming the AVX2 build: the int8 matmuls (float32 and bfloat16
    x) and the cpu-layers executor's logits, into `out`."""
    assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
    data, results = dict(np.load(inputs)), {}
    for i, (_, _, n) in enumerate(AVX2_MATMULS):
        w = cpu_kernels.pack_weight_int8(data[f"q{i}"], data[f"scale{i}"])
        for compute in (None, "bfloat16"):
            results[f"matmul{i}_{compute}"] = np.asarray(cpu_kernels.matmul(jnp.asarray(data[f"x{i}"]), w, n,
                                                                            compute))
    model = CpuLayerExecutor.load(model_dir, dtype="float32", quantization="int8")
    results["logits"] = _logits(_executor(CpuLayerExecutor, model, "float32"))
    np.savez(out, **results)


def test_avx2_build_serves_int8(hf_model_dir, tmp_path):
    """The AVX2 + FMA variant (no AVX-512: its own streamed tiles and panels) against NumPy and the XLA executor."""
    lib = cpu_kernels.build(tmp_path / "libjserve_cpu_avx2.so", ("-O1", "-mavx2", "-mfma", *cpu_kernels.LIBRARY_FLAGS))
    rng = np.random.default_rng(5)
    data = {}
    for i, (rows, k, n) in enumerate(AVX2_MATMULS):
        data[f"q{i}"], data[f"scale{i}"] = quantize_rows(rng.normal(0, 0.1, (n, k)).astype(np.float32))
        data[f"x{i}"] = rng.normal(0, 1, (rows, k)).astype(np.float32)
    np.savez(tmp_path / "inputs.npz", **data)
    model_dir = hf_model_dir("llama", hidden_size=96, intermediate_size=352)
    env = dict(os.environ, JAX_PLATFORMS="cpu", **{cpu_kernels.LIBRARY_ENV: str(lib)})
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), str(REPO), env.get("PYTHONPATH", "")])
    code = (f"import test_cpu_int8 as t; t.run_avx2({str(tmp_path / 'inputs.npz')!r}, {str(tmp_path / 'out.npz')!r}, "
            f"{str(model_dir)!r})")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = dict(np.load(tmp_path / "out.npz"))
    for i in range(len(AVX2_MATMULS)):
        w = dequantize_rows(data[f"q{i}"], data[f"scale{i}"])
        for compute in (None, "bfloat16"):
            x = data[f"x{i}"] if compute is None else np.asarray(jnp.asarray(data[f"x{i}"]).astype(compute),
                                                                   np.float32)
            want = x @ w.T
            np.testing.assert_allclose(got[f"matmul{i}_{compute}"], want, rtol=2e-5, atol=2e-5 * np.abs(want).max(),
                                       err_msg=f"{AVX2_MATMULS[i]} {compute}")
    want = _logits(_executor(XlaExecutor, load_model(model_dir, "float32", quantization="int8"), "float32"))
    np.testing.assert_allclose(got["logits"], want, rtol=1e-4, atol=1e-4)
