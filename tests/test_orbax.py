"""jserve convert and serving from its Orbax checkpoints (jserve.convert, jserve.orbax_io): the restored parameters
are bitwise the source's loaded ones, greedy tokens match serving the source (one device, and tensor parallelism in
a subprocess with 8 CPU devices), and damaged or mismatched checkpoints fail with errors naming the path."""

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
from gguf_files import write_gguf
from hf_models import load_hf
from test_parity import hf_logits, jserve_logits

from jserve.cli import main
from jserve.config import ModelLoadError
from jserve.convert import convert
from jserve.loading import load_model
from jserve.orbax_io import MARKER, PARAMS_DIR, is_orbax_checkpoint
from jserve.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["def fib(n):", "import os\nimport", "class Engine:\n    def"]


@pytest.fixture(scope="module")
def sources(hf_model_dir, tmp_path_factory) -> dict[str, Path]:
    """The tiny safetensors model and the same model as a Q8_0 GGUF file (dequantized at load)."""
    st = hf_model_dir("llama")
    gguf = write_gguf(st, tmp_path_factory.mktemp("gguf") / "tiny.gguf", "Q8_0", name="tiny-llama")
    return {"safetensors": st, "gguf": gguf}


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(source kind, dtype) -> its conversion, made once."""
    cache: dict[tuple[str, str], Path] = {}

    def make(kind: str, dtype: str) -> Path:
        if (kind, dtype) not in cache:
            cache[kind, dtype] = convert(str(sources[kind]), tmp_path_factory.mktemp("orbax") / "out", dtype)
        return cache[kind, dtype]

    return make


def _flat(state: nnx.State) -> dict[tuple, np.ndarray]:
    return {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


@pytest.mark.parametrize("kind, dtype", [("safetensors", "float32"), ("safetensors", "bfloat16"),
                                         ("gguf", "float32")])
def test_restored_params_equal_loaded_bitwise(sources, converted, kind, dtype):
    out = converted(kind, dtype)
    assert is_orbax_checkpoint(out)
    meta = json.loads((out / MARKER).read_text())
    assert (meta["format"], meta["dtype"]) == ("jserve-orbax", dtype)
    loaded, restored = load_model(sources[kind], dtype), load_model(out, dtype)
    assert restored.config == loaded.config
    want, got = _flat(loaded.state), _flat(restored.state)
    assert want.keys() == got.keys()
    assert any(array.dtype == np.dtype(dtype) for array in want.values())  # the matrices (norms stay float32)
    for path, array in want.items():
        assert got[path].dtype == array.dtype, path
        np.testing.assert_array_equal(got[path].view(np.uint8), array.view(np.uint8), err_msg=str(path))


def test_a_phi3_conversion_keeps_its_laid_out_weights_and_longrope(hf_model_dir, tmp_path):
    """Phi-3's weights are stored as loaded (split, reordered for partial rotary, scaled by the attention factor)
    and its longrope config restored whole: the restored model picks short or long factors for the context it is
    loaded for, and gives transformers' logits past original_max_position_embeddings (32)."""
    source = hf_model_dir("phi3", original_max_position_embeddings=32)
    out = convert(str(source), tmp_path / "out", "float32")
    for context, use_long in ((32, False), (256, True)):
        loaded = load_model(source, "float32", max_model_len=context)
        restored = load_model(out, "float32", max_model_len=context)
        assert restored.config == loaded.config and restored.config.rope_scaling.use_long_factors == use_long
        _assert_same_state(loaded, restored)
    _assert_transformers_logits(out, source)


def _assert_same_state(loaded, restored) -> None:
    want, got = _flat(loaded.state), _flat(restored.state)
    assert want.keys() == got.keys()
    for path, array in want.items():
        np.testing.assert_array_equal(got[path], array, err_msg=str(path))


def _assert_transformers_logits(converted, source) -> None:
    prompt = list(range(3, 43))
    (ours,) = jserve_logits(converted, [prompt], "float32")
    np.testing.assert_allclose(ours, hf_logits(load_hf(source), prompt), atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", ["gemma3", "smollm3", "qwen2_moe"])
def test_a_conversion_keeps_per_layer_differences(hf_model_dir, tmp_path, variant):
    """Gemma 3's weights are stored as loaded (norm weights with their 1 added) and its per-layer windows and
    rotary bases restored, as are SmolLM3's NoPE layers and Qwen2-MoE's dense and expert layers (stacked experts, a
    shared expert): the restored model gives transformers' logits."""
    source = hf_model_dir(variant)
    out = convert(str(source), tmp_path / "out", "float32")
    loaded, restored = load_model(source, "float32"), load_model(out, "float32")
    assert restored.config == loaded.config
    assert (restored.config.sliding_layers or restored.config.rope_layers or restored.config.moe_layers) is not None
    _assert_same_state(loaded, restored)
    _assert_transformers_logits(out, source)


@pytest.mark.parametrize("kind, executor", [("safetensors", "xla"), ("safetensors", "cpu-layers"), ("gguf", "auto")])
def test_greedy_tokens_match_the_source(sources, converted, llm_factory, kind, executor):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    source = llm_factory(sources[kind], executor=executor)
    restored = llm_factory(converted(kind, "float32"), executor=executor)
    want = [o.outputs[0].token_ids for o in source.generate(PROMPTS, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in restored.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want
    # the tokenizer written beside the parameters (copied, or for GGUF saved from the one jserve builds) encodes
    # and templates the same
    messages = [{"role": "user", "content": "hello there"}]
    assert restored.get_tokenizer().hf.encode(PROMPTS[1]) == source.get_tokenizer().hf.encode(PROMPTS[1])
    assert (restored.get_tokenizer().hf.apply_chat_template(messages, tokenize=False)
            == source.get_tokenizer().hf.apply_chat_template(messages, tokenize=False))
    assert restored.engine.model_config.eos_token_ids == source.engine.model_config.eos_token_ids


def test_an_int8_conversion_restores_the_quantized_weights_and_serves_them(sources, llm_factory, tmp_path, capsys):
    """`jserve convert --quantization int8` stores what `--quantization int8` makes at every load: the restored int8
    weights and scales are bitwise the load-time ones, serving needs no flag and gives the same greedy tokens on the
    same executor, and another scheme is refused naming the checkpoint (the C++ layer executor serves it:
    tests/test_cpu_int8.py)."""
    out = tmp_path / "int8"
    assert main(["convert", "--model", str(sources["safetensors"]), "--out", str(out), "--dtype", "bfloat16",
                 "--quantization", "int8"]) == 0
    assert "int8 weights" in capsys.readouterr().out
    assert json.loads((out / MARKER).read_text())["quantization"] == "int8"
    want = _flat(load_model(sources["safetensors"], "bfloat16", quantization="int8").state)
    got = _flat(load_model(out, "bfloat16").state)
    assert want.keys() == got.keys()
    assert sum(array.dtype == np.int8 for array in got.values()) >= 2  # the layers' matrices, with their scales
    for path, array in want.items():
        assert got[path].dtype == array.dtype, path
        np.testing.assert_array_equal(got[path].view(np.uint8), array.view(np.uint8), err_msg=str(path))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    quantized = llm_factory(sources["safetensors"], dtype="bfloat16", quantization="int8", executor="xla")
    restored = llm_factory(out, dtype="bfloat16", executor="xla")  # the same executor: the same products
    assert ([o.outputs[0].token_ids for o in restored.generate(PROMPTS, params, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in quantized.generate(PROMPTS, params, use_tqdm=False)])
    with pytest.raises(ValueError, match=rf"{out} holds int8 weights.*quantization 'fp8'"):
        load_model(out, "bfloat16", quantization="fp8")
    assert json.loads((out / MARKER).read_text())["quantized_head"] and got[("lm_head",)].dtype == np.int8


def test_an_int8_conversion_with_its_head_in_float_restores_as_stored(sources, monkeypatch, tmp_path):
    """A conversion whose LM head stayed in its dtype (one written before int8 quantized heads: no quantized_head in
    its marker) restores that head as stored, with the layers' int8 matrices."""
    out = tmp_path / "int8-float-head"
    with monkeypatch.context() as patch:
        patch.setattr("jserve.models.quantization.quantizes_head", lambda scheme: False)
        assert main(["convert", "--model", str(sources["safetensors"]), "--out", str(out), "--dtype", "bfloat16",
                     "--quantization", "int8"]) == 0
    marker = json.loads((out / MARKER).read_text())
    assert marker.pop("quantized_head") is False
    (out / MARKER).write_text(json.dumps(marker))
    got = _flat(load_model(out, "bfloat16").state)
    want = _flat(load_model(sources["safetensors"], "bfloat16").state)
    assert got[("lm_head",)].dtype == want[("lm_head",)].dtype and ("head_scale",) not in got
    np.testing.assert_array_equal(got[("lm_head",)].view(np.uint16), want[("lm_head",)].view(np.uint16))
    assert got[("layers", 0, "mlp", "down_proj", "weight")].dtype == np.int8


def test_a_compressed_tensors_checkpoint_converts_to_its_int8_weights(sources, tmp_path, capsys):
    """A compressed-tensors W8A16 source loads as int8 weights and scales without --quantization: its conversion's
    marker says int8 (else the restore expects float weights and finds scales), and restores them bitwise."""
    from test_quantization import _compressed_tensors_checkpoint

    ct = _compressed_tensors_checkpoint(sources["safetensors"], tmp_path / "ct", "int-quantized")
    out = tmp_path / "out"
    assert main(["convert", "--model", str(ct), "--out", str(out)]) == 0
    assert f"wrote {out} (float32, int8 weights)" in capsys.readouterr().out
    marker = json.loads((out / MARKER).read_text())
    assert marker["quantization"] == "int8" and marker["quantized_head"] is False
    want, got = _flat(load_model(ct, "float32").state), _flat(load_model(out, "float32").state)
    assert want.keys() == got.keys() and got[("layers", 0, "mlp", "down_proj", "weight")].dtype == np.int8
    for path, array in want.items():
        np.testing.assert_array_equal(got[path], array, err_msg=str(path))


def test_dtype_flag_must_match_the_checkpoint(converted):
    out = converted("safetensors", "bfloat16")
    with pytest.raises(ModelLoadError, match=rf"{out}.*holds bfloat16 parameters.*--dtype bfloat16"):
        load_model(out, "float32")


def test_truncated_checkpoint_is_a_clear_error(converted, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(converted("safetensors", "float32"), broken)
    data = sorted((broken / PARAMS_DIR / "ocdbt.process_0" / "d").iterdir())  # the arrays' bytes
    assert data, "found no array data files to delete"
    for path in data:
        path.unlink()
    with pytest.raises(ModelLoadError, match=rf"{broken / PARAMS_DIR}: cannot restore the Orbax checkpoint"):
        load_model(broken, "float32")
    for path in (broken / PARAMS_DIR).rglob("*"):  # every other data file too: the metadata is gone
        if path.is_file() and path.parent.name == "d":
            path.unlink()
    with pytest.raises(ModelLoadError, match=rf"{broken / PARAMS_DIR}: cannot (restore|read)"):
        load_model(broken, "float32")
    shutil.rmtree(broken / PARAMS_DIR)
    with pytest.raises(ModelLoadError, match=rf"{broken}: no {PARAMS_DIR}/"):
        load_model(broken, "float32")


def test_a_safetensors_header_whose_offsets_do_not_fit_the_shape_is_named(sources, tmp_path):
    """A source whose header gives a tensor fewer bytes than its dtype and shape take (the safetensors library
    refuses the file too) names the file and the tensor, rather than failing in a NumPy reshape."""
    import struct

    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    bent = tmp_path / "bent"
    shutil.copytree(sources["safetensors"], bent)
    raw = (bent / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    start, end = header["model.norm.weight"]["data_offsets"]
    header["model.norm.weight"]["data_offsets"] = [start, end - 4]
    text = json.dumps(header).encode()
    (bent / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length:])
    with pytest.raises(SafetensorError):
        load_file(str(bent / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=rf"{bent / 'model.safetensors'}: tensor model.norm.weight holds bytes "
                                             rf"{start}..{end - 4} \(252 bytes\), but F32 \[64\] takes 256"):
        load_model(bent, "float32")


def test_config_that_does_not_match_the_params(sources, converted, tmp_path):
    bent = tmp_path / "bent"
    shutil.copytree(converted("safetensors", "float32"), bent)
    meta = json.loads((bent / MARKER).read_text())
    meta["model_config"]["intermediate_size"] += 16
    (bent / MARKER).write_text(json.dumps(meta))
    with pytest.raises(ModelLoadError,
                       match=rf"{bent}: stored parameter layers/0/mlp/\w+/\w+ has shape \[.*configuration.*gives"):
        load_model(bent, "float32")
    meta["model_config"]["num_layers"] += 1
    (bent / MARKER).write_text(json.dumps(meta))
    with pytest.raises(ModelLoadError, match=rf"{bent}: the stored parameters do not match.*missing \['layers/"):
        load_model(bent, "float32")
    (bent / MARKER).write_text("{not json")
    with pytest.raises(ModelLoadError, match=rf"{bent / MARKER}: cannot read"):
        load_model(bent, "float32")
    (bent / MARKER).unlink()  # what an interrupted conversion leaves
    with pytest.raises(ModelLoadError, match=rf"{bent}: an unfinished jserve conversion"):
        load_model(bent, "float32")
    with pytest.raises(ModelLoadError, match=rf"{bent}: an unfinished jserve conversion"):
        convert(str(bent), tmp_path / "new")
    with pytest.raises(ModelLoadError, match=rf"{bent}: holds an unfinished conversion"):
        convert(str(sources["safetensors"]), bent)


def test_cli_convert_and_its_refusals(sources, tmp_path, capsys):
    out = tmp_path / "cli-out"
    assert main(["convert", "--model", str(sources["safetensors"]), "--out", str(out), "--dtype", "bfloat16"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert json.loads((out / MARKER).read_text())["dtype"] == "bfloat16"
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    assert main(["convert", "--model", str(sources["safetensors"]), "--out", str(out)]) == 2
    assert f"{out}: already holds a jserve Orbax checkpoint" in capsys.readouterr().err
    assert main(["convert", "--model", str(out), "--out", str(out)]) == 2
    assert f"{out}: already a jserve Orbax checkpoint" in capsys.readouterr().err
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # nothing was touched
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("keep me")
    assert main(["convert", "--model", str(sources["gguf"]), "--out", str(busy)]) == 2
    assert f"{busy}: not empty" in capsys.readouterr().err
    assert (busy / "notes.txt").read_text() == "keep me"


def test_a_gguf_file_without_a_tokenizer_leaves_nothing_behind(sources, tmp_path, monkeypatch, capsys):
    """A GGUF file with no vocabulary cannot be served: its conversion fails before writing anything, so the
    directory stays empty (not an unfinished conversion that has to be deleted before the next try)."""
    import gguf_files

    monkeypatch.setattr(gguf_files, "_add_tokenizer", lambda writer, model_dir, vocab_size: None)
    path = gguf_files.write_gguf(sources["safetensors"], tmp_path / "no-vocab.gguf", "Q8_0")
    out = tmp_path / "out"
    out.mkdir()
    assert main(["convert", "--model", str(path), "--out", str(out)]) == 2
    assert "no tokenizer.ggml.tokens (no vocabulary)" in capsys.readouterr().err
    assert list(out.iterdir()) == []


_TP_WORKER = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import numpy as np
    from flax import nnx
    from tp_workload import ENGINE_ARGS, greedy_tokens
    from jserve import LLM
    from jserve.loading import load_model
    from sharding import make_mesh

    source, converted, tp = sys.argv[1], sys.argv[2], int(sys.argv[3])
    quantization = json.loads(sys.argv[4])
    mesh = make_mesh(tp)
    want = {tuple(p): v.get_value()
            for p, v in nnx.to_flat_state(load_model(source, mesh=mesh, quantization=quantization).state)}
    got = {tuple(p): v.get_value() for p, v in nnx.to_flat_state(load_model(converted, mesh=mesh).state)}
    problems = []
    for path, array in want.items():
        restored = got[path]
        if restored.sharding != array.sharding:
            problems.append(f"{path}: sharding {restored.sharding} != {array.sharding}")
        for shard in restored.addressable_shards:
            expected = array.sharding.shard_shape(array.shape)
            if shard.data.shape != expected:
                problems.append(f"{path}: device {shard.device} holds {shard.data.shape}, its shard is {expected}")
            if not np.array_equal(np.asarray(shard.data), np.asarray(array[shard.index])):
                problems.append(f"{path}: device {shard.device} holds other values")
    sharded = sum(len({str(s.index) for s in a.addressable_shards}) > 1 for a in got.values())
    tokens = {"source_tp1": greedy_tokens(LLM(source, tensor_parallel_size=1, executor="xla",
                                              quantization=quantization, **ENGINE_ARGS)),
              "converted_tp": greedy_tokens(LLM(converted, tensor_parallel_size=tp, executor="xla", **ENGINE_ARGS))}
    print(json.dumps({"devices": jax.device_count(), "problems": problems, "sharded": sharded, "tokens": tokens}))
""")


@pytest.mark.parametrize("quantization", ["int8"])
def test_sharded_restore_under_tensor_parallelism(hf_model_dir, tmp_path, quantization):
    """TP 4 over a model with 8 heads and 2 KV heads (each KV head repeated twice): every parameter of an int8
    conversion (float norms and embeddings, int8 matrices and their scales) restores into the loader's own sharding,
    each device holding exactly its shard, and greedy tokens match TP 1 of the source (quantized at load the same
    way)."""
    source = hf_model_dir("llama", num_attention_heads=8)
    out = convert(str(source), tmp_path / "tp-out", "float32", quantization)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _TP_WORKER, str(source), str(out), "4", json.dumps(quantization)],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["devices"] == 8
    assert result["problems"] == []
    assert result["sharded"] > 0  # the check above compared real shards, not only replicated copies
    assert result["tokens"]["converted_tp"] == result["tokens"]["source_tp1"]
