"""Configuration errors caught at start-up, each naming its flag (or config.json field) and allowed range: config.json
numbers of the wrong type or sign, block_size over the C++ attention kernel's limit, Qwen2's per-layer sliding window
(matched against transformers), and the server's admission capacity across data-parallel replicas."""

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


@pytest.mark.parametrize("max_window_layers", [0, 2], ids=["every-layer", "no-layer"])
def test_qwen2_sliding_window_layers_match_transformers(hf_model_dir, max_window_layers):
    """transformers windows the Qwen2 layers at index >= max_window_layers: 0 windows both layers, 2 neither."""
    model_dir = _qwen2_windowed(hf_model_dir, max_window_layers)
    config = json.loads((model_dir / "config.json").read_text())
    assert ModelConfig.from_hf_dict(config).sliding_window == (4 if max_window_layers == 0 else None)
    hf = load_hf(model_dir)
    prompts = _prompts()
    for prompt, ours in zip(prompts, jserve_logits(model_dir, prompts, "float32"), strict=True):
        np.testing.assert_allclose(ours, hf_logits(hf, prompt), atol=1e-4, rtol=0)


def test_qwen2_window_really_differs_between_the_settings(hf_model_dir):
    """The two settings above are not the same model in disguise: with 37 tokens a 4-token window matters."""
    prompt = _prompts()[1]
    every = hf_logits(load_hf(_qwen2_windowed(hf_model_dir, 0)), prompt)
    none = hf_logits(load_hf(_qwen2_windowed(hf_model_dir, 2)), prompt)
    assert np.abs(every - none).max() > 1e-3


def test_qwen2_window_on_some_layers_only_is_refused(hf_model_dir):
    config = json.loads((_qwen2_windowed(hf_model_dir, 1) / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=r"windows 1 of 2 layers.*max_window_layers must be 0"):
        ModelConfig.from_hf_dict(config)
    # Without layer_types (older config.json files) the same rule applies through max_window_layers alone.
    config.pop("layer_types", None)
    with pytest.raises(ModelLoadError, match="max_window_layers"):
        ModelConfig.from_hf_dict(config)
    config["max_window_layers"] = 0
    assert ModelConfig.from_hf_dict(config).sliding_window == 4


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
    (lambda c: c["rope_parameters"].update(rope_type="yarn"), r"rope scaling type 'yarn' is not supported"),
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
