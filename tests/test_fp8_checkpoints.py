"""FP8 checkpoints (Hugging Face's fp8 and compressed-tensors' float-quantized): their weights read as the float
weights they stand for, against transformers' own dequantization and DeepSeek's block rule."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch
from hf_models import build_fp8_checkpoint, dequantize_fp8, load_hf
from safetensors.torch import load_file, save_file
from test_parity import _prompts, hf_logits, jserve_logits

import cpu_kernels
from checkpoints.fp8 import Fp8View
from jserve.config import ModelLoadError
from jserve.loading import load_model, served_quantization
from jserve.sampling_params import SamplingParams

EXECUTORS = ["reference", "cpu"] if cpu_kernels.available() else ["reference"]


def _assert_logits_match(model_dir, reference_dir, attention_backend: str) -> None:
    hf = load_hf(reference_dir)
    prompts = _prompts(3)
    for prompt, ours in zip(prompts, jserve_logits(model_dir, prompts, "float32", attention_backend), strict=True):
        np.testing.assert_allclose(ours, hf_logits(hf, prompt), atol=1e-4, rtol=0)


# Blocks that divide every projection (transformers derives a block's size from the scale grid): llama's 64 x 32
# blocks take several a matrix; the tiny DeepSeek-V3's and Qwen3-MoE's 8 x 8 fit their 24- and 48-wide projections
# (low-rank queries, experts). Each checked where it loads against transformers' dequantization of the same file.
@pytest.mark.parametrize(("variant", "block", "attention_backend"), [
    ("llama", (16, 32), "reference"), ("llama", (16, 32), "cpu"), ("deepseek_v3", (8, 8), "cpu"),
    ("qwen3_moe", (8, 8), "reference")], ids=["llama-xla", "llama-cpu", "deepseek_v3-cpu", "qwen3_moe-xla"])
def test_fp8_block_checkpoint_logits_match_transformers(hf_model_dir, tmp_path, variant, block, attention_backend):
    if attention_backend not in EXECUTORS:
        pytest.skip("the C++ kernels do not build here")
    ckpt = build_fp8_checkpoint(hf_model_dir(variant), tmp_path / "fp8", block)
    _assert_logits_match(ckpt, ckpt, attention_backend)


@pytest.mark.parametrize("strategy", ["channel", "tensor", "block"])
def test_compressed_tensors_fp8_checkpoint_reads_its_dequantized_weights(hf_model_dir, tmp_path, strategy):
    """llm-compressor's FP8 layout, a scale a row, a tensor (with static activation scales, which are not read) or
    a block of 16 x 24 (partial blocks at the end of every row and of down_proj's 128 columns): the logits of
    transformers running the float weights q * scale, as DeepSeek's weight_dequant expands a block's scale."""
    src = hf_model_dir("llama")
    ckpt = build_fp8_checkpoint(src, tmp_path / "ct", (16, 24), layout="compressed-tensors", strategy=strategy)
    tensors = load_file(str(ckpt / "model.safetensors"))
    floats = {name: dequantize_fp8(w, tensors[name + "_scale"], (16, 24) if strategy == "block" else None)
              if w.dtype == torch.float8_e4m3fn else w
              for name, w in tensors.items() if not name.endswith(("_scale", "input_scale"))}
    reference = tmp_path / "float"
    reference.mkdir()
    save_file(floats, str(reference / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (reference / f.name).write_bytes(f.read_bytes())
    _assert_logits_match(ckpt, reference, "reference" if strategy != "channel" else EXECUTORS[-1])


def test_fp8_view_reads_any_block_of_a_weight():
    """Shards (slices), fused rows (integer arrays) and expert stacks read the values of the whole dequantized
    weight, partial blocks included."""
    rng = np.random.default_rng(0)
    q = rng.normal(0, 100, (3, 37, 50)).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.5, 2.0, (3, 3, 4)).astype(np.float32)  # blocks of 16 x 16
    whole = np.stack([dequantize_fp8(torch.tensor(q[e].astype(np.float32)), torch.tensor(scale[e]), (16, 16)).numpy()
                      for e in range(3)])
    view = Fp8View(q, scale, (16, 16), "w", "test")
    for index in [(), (slice(1, 3), slice(5, 33)), (slice(None), np.array([36, 0, 17, 16]), slice(40, 50)),
                  (slice(2, 3), slice(0, 37), np.array([49, 15, 16]))]:
        np.testing.assert_array_equal(view.read(index, np.dtype(np.float32)), whole[index])
    rows = Fp8View(q[0], scale[0, :, :1].repeat(13, 0)[:37], None, "w", "test")  # a scale a row, [out, 1]
    np.testing.assert_array_equal(rows.read((slice(10, 20),), np.dtype(np.float32)),
                                  q[0, 10:20].astype(np.float32) * scale[0, :, :1].repeat(13, 0)[10:20])


def test_an_fp8_checkpoint_serves_as_the_platforms_one_byte_scheme(hf_model_dir, tmp_path, llm_factory):
    """Without --quantization an FP8 checkpoint serves quantized again per row as it is read (int8 on a CPU, fp8 on a
    GPU): its greedy tokens are those of transformers' own dequantization of the file, quantized to int8 alike."""
    ckpt = build_fp8_checkpoint(hf_model_dir("llama"), tmp_path / "fp8", (16, 32))
    assert served_quantization(ckpt, "auto", "cpu") == "int8" and served_quantization(ckpt, "auto", "gpu") == "fp8"
    assert served_quantization(ckpt, "dummy", "gpu") is None
    dequantized = tmp_path / "dequantized"
    load_hf(ckpt).save_pretrained(dequantized)
    config = json.loads((dequantized / "config.json").read_text())
    config.pop("quantization_config", None)
    (dequantized / "config.json").write_text(json.dumps(config))
    for f in ckpt.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (dequantized / f.name).write_bytes(f.read_bytes())
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in _prompts(4)]
    llm = llm_factory(ckpt)
    assert llm.engine.quantization == "int8"
    reference = llm_factory(dequantized, quantization="int8")
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in reference.generate(prompts, params, use_tqdm=False)]


def test_fp8_checkpoint_errors(hf_model_dir, tmp_path):
    src = hf_model_dir("llama")
    ckpt = build_fp8_checkpoint(src, tmp_path / "fp8", (16, 32))
    tensors = load_file(str(ckpt / "model.safetensors"))
    config = json.loads((ckpt / "config.json").read_text())

    def variant(name: str, drop: str | None = None, replace: dict | None = None, qc: dict | None = None):
        out = tmp_path / name
        out.mkdir()
        for f in ckpt.iterdir():
            if f.name not in ("model.safetensors", "config.json"):
                (out / f.name).write_bytes(f.read_bytes())
        save_file({**{k: v for k, v in tensors.items() if k != drop}, **(replace or {})},
                  str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps({**config, "quantization_config": {
            **config["quantization_config"], **(qc or {})}}))
        return out

    scale = "model.layers.1.mlp.down_proj.weight_scale_inv"
    cases = [
        (variant("no_scale", drop=scale), "down_proj.weight is float8 without scales"),
        (variant("bad_grid", replace={scale: torch.ones(3, 3)}), r"scales of shape \[3, 3\], expected \[4, 4\]"),
        (variant("uint8_scale", replace={scale: torch.ones(4, 4, dtype=torch.uint8)}), "jserve reads float scales"),
        (variant("stray_scale", replace={"model.layers.0.mlp.up_proj.weight": tensors[
            "model.layers.0.mlp.up_proj.weight"].float()}), "scales no float8 weight"),
        (variant("e5m2", qc={"fmt": "e5m2"}), "fmt 'e5m2' is not supported"),
        (variant("block", qc={"weight_block_size": [128]}), "weight_block_size must be two positive integers"),
    ]
    for path, message in cases:
        with pytest.raises(ModelLoadError, match=message):
            load_model(path, "float32")
    ct = build_fp8_checkpoint(src, tmp_path / "ct", (16, 24), layout="compressed-tensors", strategy="channel")
    ct_config = json.loads((ct / "config.json").read_text())
    ct_config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "group"
    (ct / "config.json").write_text(json.dumps(ct_config))
    with pytest.raises(ModelLoadError, match="not 8-bit float symmetric weights by tensor, channel or block"):
        load_model(ct, "float32")
