"""load_format="dummy": random weights of a checkpoint's shape from its config.json alone (vLLM's name), on every
executor and sharded by the rules under tensor parallelism."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from checkpoints.dummy import DUMMY_STD
from jserve import LLM, SamplingParams
from jserve.loading import load_model

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def config_only_dir(tmp_path_factory, hf_model_dir) -> Path:
    """A model directory with config.json and a tokenizer but no weight files."""
    source = hf_model_dir("qwen2")  # biases and tied embeddings: every kind of parameter
    out = tmp_path_factory.mktemp("config_only")
    for f in source.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    return out


def test_needs_no_weight_files_and_draws_by_kind(config_only_dir):
    from jserve.config import ModelLoadError

    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        load_model(config_only_dir)
    model = load_model(config_only_dir, load_format="dummy")
    flat = {"/".join(map(str, path)): np.asarray(v) for path, v in nnx.to_flat_state(model.state)}
    config = json.loads((config_only_dir / "config.json").read_text())
    assert flat["embed_tokens"].shape == (config["vocab_size"], config["hidden_size"])
    qkv = flat["layers/0/self_attn/qkv_proj/weight"]
    assert abs(qkv.std() - DUMMY_STD) < 0.1 * DUMMY_STD and abs(qkv.mean()) < 0.1 * DUMMY_STD
    assert np.all(flat["layers/0/input_layernorm/weight"] == 1.0)
    assert np.all(flat["layers/0/self_attn/qkv_proj/bias"] == 0.0)
    assert not np.array_equal(flat["layers/0/mlp/down_proj/weight"], flat["layers/1/mlp/down_proj/weight"])
    with pytest.raises(ValueError, match="load_format"):
        load_model(config_only_dir, load_format="pt")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_executor_draws_the_same_model(config_only_dir, dtype):
    """The CPU layer kernel (weights drawn, then packed on the host) and the XLA path (drawn in place) hold the same
    weights: their greedy tokens agree."""
    from pallas_kernels import resolve_backend

    backends = ["reference", resolve_backend("auto")]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = []
    for backend in dict.fromkeys(backends):
        llm = LLM(str(config_only_dir), load_format="dummy", dtype=dtype, attention_backend=backend,
                  max_model_len=128, kv_cache_memory_bytes=2 << 20, warmup=False, compilation_cache_dir="")
        out = llm.generate([{"prompt_token_ids": [5, 17, 99, 3]}, {"prompt_token_ids": list(range(3, 40))}],
                           params, use_tqdm=False)
        tokens.append([o.outputs[0].token_ids for o in out])
    assert all(t == tokens[0] for t in tokens) and all(len(t) == 12 for t in tokens[0])


def test_quantized_dummy_weights_are_the_float_draw_quantized_where_it_lives(config_only_dir):
    """int8 dummy weights on the XLA path are quantized on the device (an 8B shape never crosses the host): they
    are NumPy's quantize_rows of the float draw, and the CPU layer kernel (quantized on the host) gives the same
    greedy tokens."""
    from jserve.models.quantization import quantize_rows

    def qkv(model, name: str) -> np.ndarray:
        return np.asarray(model.state["layers"][1]["self_attn"]["qkv_proj"][name][...])

    q, scale = quantize_rows(qkv(load_model(config_only_dir, load_format="dummy"), "weight"))
    model = load_model(config_only_dir, load_format="dummy", quantization="int8")
    assert qkv(model, "weight").dtype == np.int8
    np.testing.assert_allclose(qkv(model, "scale"), scale, rtol=1e-6)
    diff = np.abs(qkv(model, "weight").astype(np.int32) - q)
    assert diff.max() <= 1 and np.mean(diff > 0) < 1e-3  # a division rounding differently at a half
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    tokens = [LLM(str(config_only_dir), load_format="dummy", quantization="int8", executor=executor,
                  max_model_len=128, kv_cache_memory_bytes=2 << 20, warmup=False, compilation_cache_dir="")
              .generate([{"prompt_token_ids": [5, 17, 99, 3]}], params, use_tqdm=False)[0].outputs[0].token_ids
              for executor in ("xla", "cpu-layers")]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 10


def test_dummy_weights_of_a_compressed_tensors_checkpoint_are_the_float_draw(config_only_dir, tmp_path):
    """A config.json with a compressed-tensors quantization_config, no weights: dummy weights are the float draw
    (quantized by --quantization int8 as any float draw is), not a draw cast to int8 (all zeros)."""
    from jserve.models.quantization import quantize_rows

    ct = tmp_path / "ct"
    shutil.copytree(config_only_dir, ct)
    config = json.loads((ct / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {
        "g": {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}}}
    (ct / "config.json").write_text(json.dumps(config))

    def down(model, name: str = "weight") -> np.ndarray:
        return np.asarray(model.state["layers"][0]["mlp"]["down_proj"][name][...])

    float_draw = down(load_model(config_only_dir, load_format="dummy"))
    np.testing.assert_array_equal(down(load_model(ct, load_format="dummy")), float_draw)
    q, scale = quantize_rows(float_draw)
    model = load_model(ct, load_format="dummy", quantization="int8")
    np.testing.assert_allclose(down(model, "scale"), scale, rtol=1e-6)
    assert np.abs(down(model).astype(np.int32) - q).max() <= 1 and np.abs(q).max() == 127


def test_sharded_draw_follows_the_rules(config_only_dir):
    """Under tensor parallelism each parameter is drawn with its rules sharding (never whole on one device), and
    the model computes what the unsharded one does, with float or int8 weights."""
    script = textwrap.dedent(f"""
        import jax, numpy as np
        from flax import nnx
        from jserve.loading import load_model
        from jserve import LLM, SamplingParams
        from sharding import logical_sharding, make_mesh
        mesh = make_mesh(2, 1)
        model = load_model({str(config_only_dir)!r}, load_format="dummy", mesh=mesh)
        for path, var in nnx.to_flat_state(model.state):
            expected = logical_sharding(mesh, var.get_metadata()["logical_axes"], var[...].shape)
            assert var[...].sharding.is_equivalent_to(expected, var[...].ndim), (path, var[...].sharding)
        qkv = model.state["layers"][0]["self_attn"]["qkv_proj"]["weight"][...]
        assert len(qkv.addressable_shards) == 2 and qkv.addressable_shards[0].data.shape[0] == qkv.shape[0] // 2
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        for quantization in (None, "int8"):  # int8: quantized on each device, scales sharded with their rows
            runs = []
            for tp in (1, 2):
                llm = LLM({str(config_only_dir)!r}, load_format="dummy", tensor_parallel_size=tp,
                          attention_backend="reference", max_model_len=64, kv_cache_memory_bytes=1 << 20,
                          warmup=False, compilation_cache_dir="", quantization=quantization, executor="xla")
                runs.append(llm.generate([{{"prompt_token_ids": [4, 8, 15, 16, 23, 42]}}], params,
                                         use_tqdm=False)[0].outputs[0].token_ids)
            assert runs[0] == runs[1], (quantization, runs)
        print("OK")
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_engine_flag():
    import argparse

    from jserve.config import EngineConfig
    from jserve.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--load-format", "dummy"])).load_format == "dummy"
    assert EngineConfig().load_format == "auto"
    with pytest.raises(ValueError, match="load_format must be one of"):
        EngineConfig(load_format="gguf-ish")
