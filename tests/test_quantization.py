"""int8 weight-only quantization: the per-channel scheme against NumPy, the quantized matmul and its compiled step
(no float copy of a weight), logits against the float model holding the dequantized weights, greedy tokens against
bfloat16, tensor parallelism, the executor choice, and the resident bytes."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from jserve.config import EngineConfig
from jserve.engine.sequence import ScheduledSeq, Sequence
from jserve.executors import XlaExecutor, choose_executor
from jserve.executors.xla import holds_quantized_weights
from jserve.loading import LoadedModel, load_model
from jserve.models.quantization import (
    HEAD_PATHS,
    dequantize_rows,
    quantize_rows,
    quantized_matmul,
    resident_bytes,
    scale_path,
)
from jserve.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parent.parent
# Sizes no other array of a step has, so a float array of a weight's shape in the HLO can only be a weight copy.
SHAPED = dict(hidden_size=96, intermediate_size=352)
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def numpy_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The scheme as written down: symmetric, per output row, scale = max|row| / 127."""
    w = w.astype(np.float32)
    scale = np.abs(w).max(axis=1) / np.float32(127)
    return np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8), scale.astype(np.float32)


def test_quantize_rows_matches_numpy_and_rejects_bad_input():
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.1, (48, 80)).astype(np.float32)
    w[5] = 0.0  # an all-zero row: scale 1, no division by zero
    q, scale = quantize_rows(w)
    ref_q, ref_scale = numpy_quantize(np.delete(w, 5, axis=0))
    np.testing.assert_array_equal(np.delete(q, 5, axis=0), ref_q)
    np.testing.assert_allclose(np.delete(scale, 5), ref_scale, rtol=1e-7)
    assert q.dtype == np.int8 and scale.dtype == np.float32 and scale[5] == 1.0 and not q[5].any()
    assert np.all(np.abs(dequantize_rows(q, scale) - w) <= scale[:, None] / 2 + 1e-7)
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_rows(np.full((2, 2), np.nan, np.float32))
    with pytest.raises(ValueError, match=r"\[out, in\] matrix"):
        quantize_rows(np.ones(4, np.float32))
    # a stack of matrices (a mixture of experts' [experts, out, in]) is quantized matrix by matrix
    stack_q, stack_scale = quantize_rows(np.stack([w, 2 * w]))
    np.testing.assert_array_equal(stack_q, np.stack([q, q]))
    np.testing.assert_allclose(stack_scale, np.stack([scale, np.where(scale == 1.0, 1.0, 2 * scale)]), rtol=1e-7)
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_rows(w, "int4")


@pytest.mark.parametrize("tokens", [3, 40])  # the fused multiply-reduce (decode) and the dot (prefill)
@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_quantized_matmul_matches_numpy_dequantize_then_matmul(tokens, compute):
    rng = np.random.default_rng(1)
    q, scale = quantize_rows(rng.normal(0, 0.1, (72, 40)).astype(np.float32))
    x = rng.normal(0, 1, (tokens, 40)).astype(np.float32)
    got = np.asarray(quantized_matmul(jnp.asarray(x), jnp.asarray(q), jnp.asarray(scale), jnp.dtype(compute)))
    xr = np.asarray(jnp.asarray(x).astype(compute).astype(jnp.float32))  # the activations as the dot reads them
    want = xr @ dequantize_rows(q, scale).T
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_fp8_scheme_matches_numpy_dequantize_then_matmul():
    """The fp8 numerics (served on GPUs only) checked here on the CPU: e4m3 values, scale = max|row| / 448."""
    rng = np.random.default_rng(3)
    w = rng.normal(0, 0.1, (24, 40)).astype(np.float32)
    q, scale = quantize_rows(w, "fp8")
    assert q.dtype == jnp.float8_e4m3fn
    np.testing.assert_allclose(scale, np.abs(w).max(axis=1) / 448, rtol=1e-6)
    deq = dequantize_rows(q, scale)
    assert np.all(np.abs(deq - w) <= np.abs(w) / 16 + scale[:, None] * 2.0**-9)  # e4m3: 3 mantissa bits
    x = rng.normal(0, 1, (5, 40)).astype(np.float32)
    got = np.asarray(quantized_matmul(jnp.asarray(x), jnp.asarray(q), jnp.asarray(scale), jnp.dtype(jnp.float32)))
    np.testing.assert_allclose(got, x @ deq.T, rtol=2e-5, atol=2e-5)


def _runner(model: LoadedModel, dtype: str = "float32") -> XlaExecutor:
    return XlaExecutor(model, dtype=dtype, num_blocks=16, block_size=16, max_num_batched_tokens=64, max_num_seqs=4,
                       max_model_len=128)


def _prefill_then_decode_logits(runner: XlaExecutor) -> np.ndarray:
    """All-position logits of a 21-token prompt, then the logits of one decode step."""
    rng = np.random.default_rng(2)
    seq = Sequence("q", rng.integers(3, 500, 21).tolist(), SamplingParams())
    seq.block_table = [3, 0]
    out = [np.asarray(runner.run(runner.prepare([ScheduledSeq(seq, 21, True)], all_logits=True)))[:21]]
    seq.num_computed_tokens = 21
    seq.append_token(7)
    out.append(np.asarray(runner.run(runner.prepare([ScheduledSeq(seq, 1, False)])))[:1])
    return np.concatenate(out)


def _quantized_paths(model: LoadedModel) -> list[tuple]:
    """The projections' weights, and the LM head's where it is quantized."""
    flat = dict(nnx.to_flat_state(model.state))
    head = [HEAD_PATHS[1] if HEAD_PATHS[1] in flat else HEAD_PATHS[0]] if ("head_scale",) in flat else []
    projections = [path for path in flat if path[-1] == "weight" and
                   (path[-2] in PROJECTIONS or path[-3:-2] == ("experts",))]  # an ExpertLinear's stack
    return projections + head


def _dequantized_float_model(quantized: LoadedModel, model_dir) -> LoadedModel:
    """The float32 model of model_dir with each quantized projection replaced by NumPy's q * scale of it."""
    qstate = dict(nnx.to_flat_state(quantized.state))
    reference = load_model(model_dir, "float32")
    pure = nnx.to_pure_dict(reference.state)
    for path in _quantized_paths(quantized):
        node = pure
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = jnp.asarray(dequantize_rows(np.asarray(qstate[path][...]),
                                                     np.asarray(qstate[scale_path(path)][...])))
    nnx.replace_by_pure_dict(reference.state, pure)
    return reference


def test_a_weight_holding_inf_is_named_when_quantized(hf_model_dir, tmp_path):
    """--quantization int8 of a checkpoint whose matrix holds an inf names the tensor (a GGUF file's by its GGUF
    name); float loading takes it."""
    import shutil

    from safetensors.numpy import save_file

    from jserve.config import ModelLoadError

    bent = tmp_path / "inf"
    shutil.copytree(hf_model_dir("llama"), bent)
    tensors = load_file(str(bent / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"][3, 4] = np.inf
    save_file(tensors, str(bent / "model.safetensors"))
    assert not np.isfinite(load_file(str(bent / "model.safetensors"))["model.layers.1.mlp.up_proj.weight"]).all()
    with pytest.raises(ModelLoadError, match=rf"{bent}: cannot quantize model.layers.1.mlp.gate_proj.weight/"
                                             r"model.layers.1.mlp.up_proj.weight to int8 \(.*inf or NaN\)"):
        load_model(bent, "float32", quantization="int8")
    load_model(bent, "float32")
    from gguf_files import write_gguf

    path = write_gguf(bent, tmp_path / "inf.gguf")
    with pytest.raises(ModelLoadError, match=r"inf.gguf: cannot quantize blk.1.ffn_gate.weight/blk.1.ffn_up.weight"):
        load_model(path, "float32", quantization="int8")


def test_loaded_weights_are_the_checkpoint_quantized_per_row(hf_model_dir):
    model_dir = hf_model_dir("llama")
    model = load_model(model_dir, "float32", quantization="int8")
    state = dict(nnx.to_flat_state(model.state))
    tensors = load_file(str(model_dir / "model.safetensors"))
    for layer in range(model.config.num_layers):
        prefix = f"model.layers.{layer}."
        checkpoint = {
            "qkv_proj": np.concatenate([tensors[prefix + f"self_attn.{p}_proj.weight"] for p in "qkv"]),
            "o_proj": tensors[prefix + "self_attn.o_proj.weight"],
            "gate_up_proj": np.concatenate([tensors[prefix + f"mlp.{p}_proj.weight"] for p in ("gate", "up")]),
            "down_proj": tensors[prefix + "mlp.down_proj.weight"],
        }
        for name, w in checkpoint.items():
            block = "self_attn" if name in ("qkv_proj", "o_proj") else "mlp"
            q = np.asarray(state[("layers", layer, block, name, "weight")][...])
            scale = np.asarray(state[("layers", layer, block, name, "scale")][...])
            ref_q, ref_scale = numpy_quantize(w)
            assert q.dtype == np.int8 and scale.dtype == np.float32
            np.testing.assert_array_equal(q, ref_q)
            np.testing.assert_allclose(scale, ref_scale, rtol=1e-7)
    # the LM head is quantized per vocabulary row too; an untied model's input embeddings stay in its dtype
    ref_q, ref_scale = numpy_quantize(tensors["lm_head.weight"])
    np.testing.assert_array_equal(np.asarray(state[("lm_head",)][...]), ref_q)
    np.testing.assert_allclose(np.asarray(state[("head_scale",)][...]), ref_scale, rtol=1e-7)
    assert state[("embed_tokens",)][...].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(state[("embed_tokens",)][...]), tensors["model.embed_tokens.weight"])
    fp8 = dict(nnx.to_flat_state(load_model(model_dir, "float32", quantization="fp8").state))
    assert fp8[("lm_head",)][...].dtype == jnp.float32 and ("head_scale",) not in fp8  # fp8 keeps the head


# qwen2: q/k/v biases and tied embeddings; qwen2_moe: every expert's matrices (the router in float) and the shared
# expert's
@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen2_moe"])
@pytest.mark.parametrize("scheme", ["int8", "fp8"])  # fp8: the GPU scheme's model and step, XLA emulating e4m3 here
def test_quantized_logits_match_float_model_with_dequantized_weights(hf_model_dir, variant, scheme):
    model_dir = hf_model_dir(variant)
    quantized = load_model(model_dir, "float32", quantization=scheme)
    assert {np.dtype(v[...].dtype) for p, v in nnx.to_flat_state(quantized.state) if p in _quantized_paths(quantized)} \
        == {np.dtype(jnp.int8 if scheme == "int8" else jnp.float8_e4m3fn)}
    reference = _dequantized_float_model(quantized, model_dir)
    got = _prefill_then_decode_logits(_runner(quantized))
    want = _prefill_then_decode_logits(_runner(reference))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    plain = _prefill_then_decode_logits(_runner(load_model(model_dir, "float32")))
    assert np.abs(got - plain).max() > 1e-4  # the weights really changed: the match above is not trivially true


def _float_weight_copies(hlo: str, model: LoadedModel) -> list[str]:
    """Float buffers of a compiled HLO module with the shape of a quantized weight (either orientation): the
    results of instructions outside fusion bodies (inside a fusion a converted element lives in registers)."""
    shapes = set()
    for path, var in nnx.to_flat_state(model.state):
        if path[-1] == "weight" and path[-2] in PROJECTIONS:
            out, inp = var[...].shape
            shapes |= {f"{out},{inp}", f"{inp},{out}"}
    pattern = re.compile(r"= (?:f32|bf16|f16)\[(\d+,\d+)\]")
    found, in_fusion = set(), False
    for line in hlo.splitlines():
        if line and not line.startswith(" "):  # a computation's header (or its closing brace)
            in_fusion = line.startswith("%fused") or "fusion" in line.split("(")[0]
            continue
        match = pattern.search(line)
        if match and not in_fusion and match.group(1) in shapes:
            found.add(line.strip()[:160])
    return sorted(found)


def test_decode_step_holds_no_float_copy_of_a_weight(hf_model_dir):
    model = load_model(hf_model_dir("llama", **SHAPED), "bfloat16", quantization="int8")
    runner = _runner(model, "bfloat16")
    seq = Sequence("q", list(range(3, 12)), SamplingParams())
    seq.block_table = [0]
    decode = runner.prepare([ScheduledSeq(seq, 1, True)])
    _, lowered = runner.lower_step(decode)
    compiled = lowered.compile()
    assert _float_weight_copies(compiled.as_text(), model) == []
    # The check sees a copy where there is one: a 40-token prefill step converts each weight for its dot on CPU.
    long = Sequence("p", list(range(3, 43)), SamplingParams())
    long.block_table = [1, 2, 3]
    prefill = runner.prepare([ScheduledSeq(long, 40, True)])
    _, lowered = runner.lower_step(prefill)
    assert _float_weight_copies(lowered.compile().as_text(), model) != []


def test_int8_greedy_tokens_mostly_agree_with_bfloat16(hf_model_dir, llm_factory):
    model_dir = hf_model_dir("llama")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(5 + i, 25 + 3 * i, 2))} for i in range(4)]
    bf16 = llm_factory(model_dir, dtype="bfloat16", executor="xla")
    int8 = llm_factory(model_dir, dtype="bfloat16", executor="xla", quantization="int8")
    # On a GPU the int8 engine's steps compile with the autotuned Triton GEMM (step_compiler_options)
    assert holds_quantized_weights(int8.engine.executor.params)
    assert not holds_quantized_weights(bf16.engine.executor.params)
    a = [o.outputs[0].token_ids for o in bf16.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in int8.generate(prompts, params, use_tqdm=False)]
    # Agreement up to the first divergence of each stream (after it the two continue different texts).
    agree = sum(next((i for i, (x, y) in enumerate(zip(s, t, strict=True)) if x != y), len(s))
                for s, t in zip(a, b, strict=True))
    fraction = agree / sum(map(len, a))
    print(f"int8 vs bfloat16 greedy agreement before first divergence: {fraction:.2f}")
    assert fraction >= 0.5, (a, b)


_TP_SCRIPT = """
import json, os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
from tp_workload import ENGINE_ARGS, greedy_tokens
from jserve import LLM
tokens = {tp: greedy_tokens(LLM(sys.argv[1], tensor_parallel_size=tp, quantization="int8",
                                executor=sys.argv[2], **ENGINE_ARGS)) for tp in (1, 2)}
print(json.dumps(tokens))
"""


@pytest.mark.parametrize("executor", ["xla", "cpu-layers"])
def test_tensor_parallel_int8_matches_one_device(hf_model_dir, executor):
    """Sharded, both executors run the Flax model's quantized Linears under XLA (scales sharded with their rows);
    on one device cpu-layers runs the layer kernel. Both give the one-device tokens."""
    path = os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, "-c", _TP_SCRIPT, str(hf_model_dir("llama", num_attention_heads=8)),
                           executor], capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    tokens = json.loads(proc.stdout.strip().splitlines()[-1])
    assert tokens["1"] == tokens["2"] and all(tokens["1"])


def test_executor_choice_and_errors():
    # int8 runs on the C++ layer kernels too (tests/test_cpu_int8.py); the XLA executor serves it when asked
    assert choose_executor("xla", "auto", platform="cpu", quantization="int8")[0] is XlaExecutor
    with pytest.raises(ValueError, match="fp8 weights need a GPU.*use int8"):
        choose_executor("auto", "auto", platform="cpu", quantization="fp8")
    assert choose_executor("xla", "reference", platform="gpu", quantization="fp8")[0] is XlaExecutor
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int4")


def test_resident_weight_bytes_about_half_of_bfloat16(hf_model_dir, llm_factory, caplog):
    model_dir = hf_model_dir("llama", **SHAPED)
    bf16 = load_model(model_dir, "bfloat16")
    int8 = load_model(model_dir, "bfloat16", quantization="int8")
    projections = _quantized_paths(int8)
    state16, state8 = dict(nnx.to_flat_state(bf16.state)), dict(nnx.to_flat_state(int8.state))
    bytes16 = sum(state16[p][...].nbytes for p in projections)
    assert ("lm_head",) in projections  # the head too
    bytes8 = sum(state8[p][...].nbytes + state8[scale_path(p)][...].nbytes for p in projections)
    assert 0.5 <= bytes8 / bytes16 < 0.55
    assert resident_bytes(bf16.state) - resident_bytes(int8.state) == bytes16 - bytes8
    with caplog.at_level(logging.INFO, logger="jserve.engine.engine"):
        llm_factory(model_dir, dtype="bfloat16", executor="xla", quantization="int8")
    logged = [r.getMessage() for r in caplog.records if "resident weight bytes" in r.getMessage()]
    assert logged and f"resident weight bytes {resident_bytes(int8.state)} " in logged[-1]


def _pack_int32(q: np.ndarray) -> np.ndarray:
    """compressed-tensors' pack_to_int32 for 8 bits, as its docs spell it: offset to unsigned, zero-pad the input
    axis to a multiple of 4, value 4j + i into bits 8i.. of word j."""
    u = (q.astype(np.int32) + 128).astype(np.uint32)
    u = np.pad(u, ((0, 0), (0, -u.shape[1] % 4)))
    words = np.zeros((u.shape[0], u.shape[1] // 4), np.uint32)
    for i in range(4):
        words |= u[:, i::4] << (8 * i)
    return words.view(np.int32)


def _compressed_tensors_checkpoint(src: Path, out: Path, fmt: str, **weights_args) -> Path:
    """A W8A16 compressed-tensors copy of a float checkpoint: every decoder projection int8 per channel."""
    import shutil

    from safetensors.numpy import save_file

    out.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    tensors = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        base, _, kind = name.rpartition(".")
        if kind != "weight" or base.rsplit(".", 1)[-1] not in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj"):
            tensors[name] = w
            continue
        q, scale = numpy_quantize(w)
        tensors[base + ".weight_scale"] = scale[:, None].astype(np.float16 if fmt == "int-quantized" else np.float32)
        if fmt == "pack-quantized":
            tensors[base + ".weight_packed"] = _pack_int32(q)
            tensors[base + ".weight_shape"] = np.asarray(q.shape, np.int32)
        else:
            tensors[base + ".weight"] = q
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    weights = dict(num_bits=8, type="int", symmetric=True, strategy="channel", **weights_args)
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
                                     "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                                   "input_activations": None}}}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("fmt", ["int-quantized", "pack-quantized"])
def test_compressed_tensors_w8a16_checkpoint_loads_its_int8_weights(hf_model_dir, tmp_path, fmt):
    src = hf_model_dir("llama", intermediate_size=130)  # down_proj: 130 columns, the last packed word padded
    ckpt = _compressed_tensors_checkpoint(src, tmp_path / "ct", fmt)
    model = load_model(ckpt, "float32")
    state = dict(nnx.to_flat_state(model.state))
    tensors = load_file(str(src / "model.safetensors"))
    for layer in range(model.config.num_layers):
        prefix = f"model.layers.{layer}."
        for name, parts, block in (("qkv_proj", ("q_proj", "k_proj", "v_proj"), "self_attn"),
                                   ("o_proj", ("o_proj",), "self_attn"),
                                   ("gate_up_proj", ("gate_proj", "up_proj"), "mlp"),
                                   ("down_proj", ("down_proj",), "mlp")):
            w = np.concatenate([tensors[f"{prefix}{block}.{p}.weight"] for p in parts])
            ref_q, ref_scale = numpy_quantize(w)
            if fmt == "int-quantized":  # the checkpoint stores float16 scales
                ref_scale = ref_scale.astype(np.float16).astype(np.float32)
            q = np.asarray(state[("layers", layer, block, name, "weight")][...])
            scale = np.asarray(state[("layers", layer, block, name, "scale")][...])
            np.testing.assert_array_equal(q, ref_q)
            np.testing.assert_array_equal(scale, ref_scale)
    # logits: the float model holding the dequantized weights (NumPy: q * scale)
    reference = _dequantized_float_model(model, src)
    np.testing.assert_allclose(_prefill_then_decode_logits(_runner(model)),
                               _prefill_then_decode_logits(_runner(reference)), rtol=1e-4, atol=1e-4)


def test_compressed_tensors_checkpoint_errors(hf_model_dir, llm_factory, tmp_path):
    from jserve.config import ModelLoadError

    src = hf_model_dir("llama")
    group = _compressed_tensors_checkpoint(src, tmp_path / "group", "int-quantized")
    config = json.loads((group / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "group"
    (group / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="not W8A16 int8 symmetric per-channel"):
        load_model(group, "float32")
    config["quantization_config"]["quant_method"] = "gptq"
    (group / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="quant_method 'gptq' is not supported"):
        load_model(group, "float32")
    ok = _compressed_tensors_checkpoint(src, tmp_path / "ok", "int-quantized")
    with pytest.raises(ValueError, match="does not apply"):
        load_model(ok, "float32", quantization="fp8")
    # the engine serves such a checkpoint as int8, on the executor `auto` picks (tests/test_cpu_int8.py: cpu-layers)
    llm = llm_factory(ok, executor="xla")
    assert type(llm.engine.executor) is XlaExecutor and llm.engine.quantization == "int8"
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
