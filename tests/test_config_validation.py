"""Configuration errors caught at start-up, each naming its flag (or config.json field) and allowed range: config.json
numbers of the wrong type or sign, block_size over the C++ attention kernel's limit, Qwen2's per-layer sliding window
(matched against transformers), Gemma's fields, and the server's admission capacity across data-parallel
replicas."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
from hf_models import load_hf
from test_parity import _prompts, hf_logits, jserve_logits

import cpu_kernels
from jserve.config import EngineConfig, ModelConfig, ModelLoadError
from jserve.engine.engine import LLMEngine
from jserve.executors.cpu_layers import MAX_BLOCK_SIZE
from jserve.server.async_engine import AsyncEngine

SMALL = dict(max_model_len=128, kv_cache_memory_bytes=1 << 20, max_num_batched_tokens=64, max_num_seqs=4,
             warmup=False, compilation_cache_dir="")


@pytest.mark.skipif(not cpu_kernels.available(), reason="the C++ kernels do not build here")
def test_block_size_over_the_cpu_kernel_limit_fails_at_construction(hf_model_dir):
    model_dir = hf_model_dir("llama")
    with pytest.raises(ValueError, match=rf"block_size {2 * MAX_BLOCK_SIZE} .*must be in \[1, {MAX_BLOCK_SIZE}\]"):
        LLMEngine(EngineConfig(model=str(model_dir), block_size=2 * MAX_BLOCK_SIZE, executor="cpu-layers", **SMALL))
    # The limit is the kernel's own: a page of MAX_BLOCK_SIZE tokens runs, and the XLA reference takes larger ones.
    for block_size, backend in ((MAX_BLOCK_SIZE, "auto"), (2 * MAX_BLOCK_SIZE, "reference")):
        engine = LLMEngine(EngineConfig(model=str(model_dir), block_size=block_size, attention_backend=backend,
                                        **SMALL))
        engine.add_request("r", [5, 6, 7, 8])
        while engine.has_unfinished_requests():
            engine.step()


def _qwen2_windowed(hf_model_dir, max_window_layers: int):
    return hf_model_dir("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=max_window_layers)


@pytest.mark.parametrize(("max_window_layers", "attention_backend"),
                         [(0, "reference"), (1, "reference"), (1, "cpu"), (2, "reference")],
                         ids=["every-layer", "second-layer", "second-layer-cpu-layers", "no-layer"])
def test_qwen2_sliding_window_layers_match_transformers(hf_model_dir, max_window_layers, attention_backend):
    """transformers windows the Qwen2 layers at index >= max_window_layers: 0 windows both layers, 1 the second
    only, 2 neither."""
    if attention_backend == "cpu" and not cpu_kernels.available():
        pytest.skip("the C++ kernels do not build here")
    model_dir = _qwen2_windowed(hf_model_dir, max_window_layers)
    config = ModelConfig.from_hf_dict(json.loads((model_dir / "config.json").read_text()))
    assert [config.layer_window(i) for i in range(2)] == [None if i < max_window_layers else 4 for i in range(2)]
    hf = load_hf(model_dir)
    prompts = _prompts()
    for prompt, ours in zip(prompts, jserve_logits(model_dir, prompts, "float32", attention_backend), strict=True):
        np.testing.assert_allclose(ours, hf_logits(hf, prompt), atol=1e-4, rtol=0)


def test_qwen2_window_really_differs_between_the_settings(hf_model_dir):
    """The settings above are not the same model in disguise: with 37 tokens a 4-token window matters."""
    prompt = _prompts()[1]
    logits = [hf_logits(load_hf(_qwen2_windowed(hf_model_dir, layers)), prompt) for layers in (0, 1, 2)]
    assert np.abs(logits[0] - logits[1]).max() > 1e-3
    assert np.abs(logits[1] - logits[2]).max() > 1e-3


def test_qwen2_layer_types_without_max_window_layers(hf_model_dir):
    """Older config.json files have no layer_types: max_window_layers alone says which layers slide."""
    config = json.loads((_qwen2_windowed(hf_model_dir, 1) / "config.json").read_text())
    with_types = ModelConfig.from_hf_dict(config)
    config.pop("layer_types", None)
    assert ModelConfig.from_hf_dict(config) == with_types
    assert with_types.sliding_layers == (False, True)
    config["max_window_layers"] = -1
    with pytest.raises(ModelLoadError, match="max_window_layers must be a non-negative integer, got -1"):
        ModelConfig.from_hf_dict(config)


def test_capacity_counts_every_data_parallel_replica():
    def engine(dp: int):
        return types.SimpleNamespace(config=types.SimpleNamespace(max_num_seqs=8, data_parallel_size=dp))

    assert AsyncEngine(engine(1), max_queued_requests=10).capacity == 18
    assert AsyncEngine(engine(3), max_queued_requests=10).capacity == 3 * 8 + 10


def _drop(config: dict, key: str) -> None:
    """Remove key from the config's top level and its rope_parameters (transformers writes it in both)."""
    config.pop(key)
    config["rope_parameters"].pop(key)


@pytest.mark.parametrize(("bend", "message"), [
    (lambda c: c["rope_parameters"].update(short_factor=[1.0, 2.0]), r"longrope short_factor must be a list of 4 "),
    (lambda c: c["rope_parameters"].update(long_factor=[1.0, 2.0, 0.0, 1.0]), r"longrope long_factor must be a list"),
    (lambda c: _drop(c, "original_max_position_embeddings"),
     r"original_max_position_embeddings must be a positive integer, got None"),
    (lambda c: c.update(partial_rotary_factor=0.3125) or c["rope_parameters"].update(partial_rotary_factor=0.3125),
     r"partial_rotary_factor 0.3125 rotates 5 of 16 head dimensions"),
    (lambda c: c["rope_parameters"].update(rope_type="dynamic"), r"rope scaling type 'dynamic' is not supported"),

])
def test_a_phi3_config_jserve_cannot_run_names_the_field(hf_model_dir, tmp_path, bend, message):
    config = json.loads((hf_model_dir("phi3") / "config.json").read_text())
    bend(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize(("field", "value"), [("hidden_size", "64"), ("num_hidden_layers", -1), ("vocab_size", 0),
                                              ("num_attention_heads", True), ("intermediate_size", 128.0),
                                              ("num_key_value_heads", "2"), ("head_dim", -8),
                                              ("max_position_embeddings", "2048"), ("rms_norm_eps", "1e-6")])
def test_a_config_json_number_of_the_wrong_type_or_sign_names_the_file_and_field(hf_model_dir, tmp_path, field, value):
    config = json.loads((hf_model_dir("llama") / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=rf"config\.json: {field} must be a positive (integer|number), got "):
        ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("name", ["su", "yarn"])
def test_phi3_early_rope_names_read_as_longrope(hf_model_dir, tmp_path, name):
    """Phi-3's early configs call longrope "su" or "yarn"; transformers' Phi3Config reads both as longrope."""
    config = json.loads((hf_model_dir("phi3") / "config.json").read_text())
    config["rope_parameters"]["rope_type"] = name
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert ModelConfig.from_pretrained(tmp_path).rope_scaling == ModelConfig.from_pretrained(
        hf_model_dir("phi3")).rope_scaling


def test_a_window_as_long_as_the_context_is_none():
    """Phi-3.5's sliding_window 262144 over 131072 positions hides no key: the model runs without a window."""
    base = dict(model_type="phi3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=2048)
    assert ModelConfig.from_hf_dict({**base, "sliding_window": 262144}).sliding_window is None
    assert ModelConfig.from_hf_dict({**base, "sliding_window": 2048}).sliding_window is None
    assert ModelConfig.from_hf_dict({**base, "sliding_window": 2047}).sliding_window == 2047


@pytest.mark.parametrize("field", ["embedding_multiplier", "attention_multiplier", "residual_multiplier",
                                   "logits_scaling"])
def test_a_granite_multiplier_that_is_not_a_positive_number_is_named(hf_model_dir, tmp_path, field):
    config = json.loads((hf_model_dir("granite") / "config.json").read_text())
    config[field] = "0.5"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=rf"config\.json: {field} must be a positive number, got '0.5'"):
        ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize(("variant", "bend", "message"), [
    ("gemma2", lambda c: c.update(layer_types=["sliding_attention"]), r"layer_types must list 2 layer kinds"),
    ("gemma2", lambda c: c.update(layer_types=["sliding_attention", "chunked_attention"]),
     r"layer_types must list 2 layer kinds, each one of \('sliding_attention', 'full_attention'\)"),
    ("gemma2", lambda c: c.update(hidden_activation="relu"), r"hidden activation 'relu' is not supported"),
    ("gemma2", lambda c: c.update(attn_logit_softcapping=-1.0), r"attn_logit_softcapping must be a positive number"),
    ("gemma2", lambda c: c.update(query_pre_attn_scalar=0), r"query_pre_attn_scalar must be a positive number"),
    ("gemma3", lambda c: c.update(use_bidirectional_attention=True), r"use_bidirectional_attention .* not supported"),
    ("gemma3", lambda c: c["rope_parameters"]["sliding_attention"].update(rope_type="linear", factor=2.0),
     r"rope scaling 'linear' of the sliding-window layers is not supported"),
    ("llama", lambda c: c.update(hidden_act="gelu"), r"hidden activation 'gelu' is not supported"),
    ("llama", lambda c: c["rope_parameters"].update(rope_type="yarn", factor=4.0, truncate="no"),
     r"rope truncate must be true or false, got 'no'"),
    ("llama", lambda c: c["rope_parameters"].update(rope_type="yarn", factor=-2.0),
     r"rope factor must be a positive number"),
    ("olmoe", lambda c: c.update(clip_qkv=-1.0), r"clip_qkv must be a positive number, got -1.0"),
    ("olmo3", lambda c: c.update(layer_types=["sliding_attention"] * 3), r"layer_types must list 4 layer kinds"),
    ("smollm3", lambda c: c.update(no_rope_layers=[1]), r"no_rope_layers must list 2 flags"),
    ("smollm3", lambda c: c.update(no_rope_layers=[1, 2]), r"no_rope_layers must list 2 flags"),
    ("deepseek_v2", lambda c: c.update(topk_method="noaux_tc"),
     r"topk_method must be greedy or group_limited_greedy, got 'noaux_tc'"),
    ("deepseek_v2", lambda c: c.update(qk_rope_head_dim=7), r"qk_rope_head_dim must be even"),
    ("deepseek_v3", lambda c: c.update(n_group=3), r"8 experts in n_group=3 groups"),
    ("deepseek_v3", lambda c: c.update(kv_lora_rank=0), r"kv_lora_rank must be a positive integer, got 0"),
    ("deepseek_v3", lambda c: c.update(first_k_dense_replace=-1), r"first_k_dense_replace must be a non-negative"),
])
def test_a_gemma_or_smollm3_config_jserve_cannot_run_names_the_field(hf_model_dir, tmp_path, variant, bend, message):
    config = json.loads((hf_model_dir(variant) / "config.json").read_text())
    bend(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_pretrained(tmp_path)


def test_gemma3_older_config_fields_read_as_rope_parameters():
    """Gemma 3 checkpoints published before transformers 5 keep rope_theta, rope_scaling and rope_local_base_freq at
    the top level (google/gemma-3-4b-it's text config, abridged): the same fields as the nested form."""
    old = dict(model_type="gemma3_text", vocab_size=262208, hidden_size=2560, intermediate_size=10240,
               num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
               query_pre_attn_scalar=256, rope_theta=1000000.0, rope_local_base_freq=10000.0,
               rope_scaling={"factor": 8.0, "rope_type": "linear"}, sliding_window=1024, sliding_window_pattern=6,
               max_position_embeddings=131072, hidden_activation="gelu_pytorch_tanh")
    config = ModelConfig.from_hf_dict(old)
    assert (config.rope_theta, config.local_rope_theta) == (1e6, 1e4)
    assert (config.rope_scaling.kind, config.rope_scaling.factor) == ("linear", 8.0)
    assert [config.layer_window(i) for i in range(6)] == [1024] * 5 + [None]
    assert config.layer_rope_theta(0) == 1e4 and config.layer_rope_theta(5) is None
    assert config.attention_scale == 256**-0.5 and config.qk_norm and config.sandwich_norms
    new = {**old, "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    for key in ("rope_theta", "rope_local_base_freq", "rope_scaling"):
        new.pop(key)
    assert ModelConfig.from_hf_dict(new) == config


@pytest.mark.parametrize("attention_backend", ["reference", "cpu"], ids=["xla", "cpu-layers"])
def test_smollm3_windows_its_nope_layers_as_transformers(hf_model_dir, attention_backend):
    """SmolLM3 with use_sliding_window windows the layers without rotary embedding (its layer_types, or derived from
    no_rope_layers in older files), on both executors."""
    if attention_backend == "cpu" and not cpu_kernels.available():
        pytest.skip("the C++ kernels do not build here")
    model_dir = hf_model_dir("smollm3", use_sliding_window=True, sliding_window=4)
    config = json.loads((model_dir / "config.json").read_text())
    parsed = ModelConfig.from_hf_dict(config)
    assert [parsed.layer_window(i) for i in range(2)] == [None, 4] and parsed.rope_layers == (True, False)
    config.pop("layer_types")
    assert ModelConfig.from_hf_dict(config) == parsed
    hf = load_hf(model_dir)
    prompts = _prompts()
    for prompt, ours in zip(prompts, jserve_logits(model_dir, prompts, "float32", attention_backend), strict=True):
        np.testing.assert_allclose(ours, hf_logits(hf, prompt), atol=1e-4, rtol=0)
    # the window matters for these prompts
    unwindowed = load_hf(hf_model_dir("smollm3"))
    assert np.abs(hf_logits(unwindowed, prompts[1]) - hf_logits(hf, prompts[1])).max() > 1e-3
