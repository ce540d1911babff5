"""jserve's logits and greedy tokens against Hugging Face transformers running the same weights."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_models import VARIANTS, build_gpt_oss_mxfp4, load_hf

import cpu_kernels
from jserve.config import ModelConfig
from jserve.engine.sequence import ScheduledSeq, Sequence
from jserve.executors import CpuLayerExecutor, XlaExecutor
from jserve.lora import LoRARequest, load_adapter
from jserve.sampling_params import SamplingParams

PROMPT_LENS = (5, 37, 20, 1)
# bfloat16: both sides round weights to bf16; transformers also keeps activations in bf16 while jserve keeps the
# residual stream in float32, so the gap is bf16 activation rounding (documented in docs/architecture.md).
BF16_LOGIT_TOLERANCE = 0.15


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 390, n).tolist() for n in PROMPT_LENS]


def jserve_logits(model_dir, prompts: list[list[int]], dtype: str, attention_backend: str = "reference",
                  adapters: tuple = (), slots: list[int] | None = None, max_lora_rank: int = 8) -> list[np.ndarray]:
    """All-position logits of every prompt, computed in one ragged step over a paged cache. adapters: PEFT LoRA
    directories written into slots 0, 1, ...; slots: each prompt's adapter slot (-1: none)."""
    executor = CpuLayerExecutor if attention_backend == "cpu" else XlaExecutor
    model = executor.load(model_dir, dtype=dtype, attention_backend=attention_backend, max_model_len=256,
                          lora=(len(adapters), max_lora_rank) if adapters else (0, 0))
    runner = executor(model, dtype=dtype, num_blocks=32, block_size=16, max_num_batched_tokens=128, max_num_seqs=8,
                      max_model_len=256)
    for slot, path in enumerate(adapters):
        request = LoRARequest(f"a{slot}", slot + 1, str(path))
        runner.set_lora(slot, load_adapter(request, model.config, max_lora_rank))
    chunks, next_block = [], 0
    for i, p in enumerate(prompts):
        seq = Sequence("parity", p, SamplingParams())
        seq.lora_slot = -1 if slots is None else slots[i]
        needed = -(-len(p) // 16)
        seq.block_table = list(range(next_block, next_block + needed))[::-1]  # pages out of order on purpose
        next_block += needed
        chunks.append(ScheduledSeq(seq, len(p), True))
    batch = runner.prepare(chunks)
    batch.logits_indices = np.arange(len(batch.token_ids), dtype=np.int32)
    logits = np.asarray(runner.run(batch), dtype=np.float32)
    starts = np.cumsum([0, *map(len, prompts)])
    return [logits[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]


def hf_logits(model, prompt: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().numpy()


def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_float32_logits_match_transformers(hf_model_dir, variant):
    model_dir = hf_model_dir(variant)
    hf = load_hf(model_dir)
    prompts = _prompts()
    for prompt, ours in zip(prompts, jserve_logits(model_dir, prompts, "float32"), strict=True):
        np.testing.assert_allclose(ours, hf_logits(hf, prompt), atol=1e-4, rtol=0)


@pytest.mark.skipif(not cpu_kernels.available(), reason="the C++ kernels do not build here")
@pytest.mark.parametrize("variant", ["gemma", "gemma2", "gemma3", "smollm3", "glm4", "mixtral", "qwen2_moe",
                                     "glm4_moe", "olmo2", "olmoe", "gpt_oss", "deepseek_v2", "deepseek_v3",
                                     "granitemoeshared"])
def test_float32_logits_of_the_layer_kernel_match_transformers(hf_model_dir, variant):
    """The C++ layer kernel's GELU, sandwich norms (GLM-4's too) and score soft cap, and its one call per run of
    alike layers (Gemma 2's alternating windows, Gemma 3's local rotary base, SmolLM3's NoPE layers); for a mixture
    of experts and OLMo's blocks, which the layer kernel does not take, the Flax model on that executor's packed
    matmuls (experts read in place from their stacks, a shared expert, a dense layer; gpt-oss's attention sinks and
    DeepSeek's latent attention in the C++ attention)."""
    model_dir = hf_model_dir(variant)
    hf = load_hf(model_dir)
    prompts = _prompts()
    for prompt, ours in zip(prompts, jserve_logits(model_dir, prompts, "float32", "cpu"), strict=True):
        np.testing.assert_allclose(ours, hf_logits(hf, prompt), atol=1e-4, rtol=0)


@pytest.mark.parametrize("attention_backend", ["reference", "cpu"] if cpu_kernels.available() else ["reference"])
def test_gpt_oss_mxfp4_checkpoint_logits_match_transformers(tmp_path_factory, attention_backend):
    """gpt-oss as OpenAI publishes it, its experts in MXFP4: transformers dequantizes them its own way
    (convert_moe_packed_tensors); jserve's logits from the same file match, on both executors."""
    model_dir = build_gpt_oss_mxfp4(tmp_path_factory.mktemp("gpt_oss_mxfp4"))
    hf = load_hf(model_dir)
    prompts = _prompts(2)
    for prompt, ours in zip(prompts, jserve_logits(model_dir, prompts, "float32", attention_backend), strict=True):
        np.testing.assert_allclose(ours, hf_logits(hf, prompt), atol=1e-4, rtol=0)


# deepseek_v3 with dense MLPs only: its latent attention in bfloat16, without a mixture of experts, whose routing a
# near tie may flip between two roundings (then one token's logits differ by far more than rounding)
@pytest.mark.parametrize(("variant", "overrides"), [("llama", {}), ("qwen3", {}), ("gemma2", {}), ("gemma3", {}),
                                                    ("deepseek_v3", {"first_k_dense_replace": 2})],
                         ids=["llama", "qwen3", "gemma2", "gemma3", "deepseek_v3-dense"])
def test_bfloat16_logits_within_tolerance(hf_model_dir, variant, overrides):
    """bfloat16 logits within BF16_LOGIT_TOLERANCE of transformers' bfloat16 ones, and no further from its float32
    logits than its bfloat16 ones are (with a little slack: the two round differently, and on AMX machines XLA's
    dots round differently again)."""
    model_dir = hf_model_dir(variant, **overrides)
    hf, hf32 = load_hf(model_dir, torch.bfloat16), load_hf(model_dir)
    prompts = _prompts(1)
    for prompt, ours in zip(prompts, jserve_logits(model_dir, prompts, "bfloat16"), strict=True):
        theirs, exact = hf_logits(hf, prompt), hf_logits(hf32, prompt)
        assert np.abs(ours - theirs).max() < 1.25 * BF16_LOGIT_TOLERANCE
        assert np.abs(ours - exact).max() <= 1.25 * np.abs(theirs - exact).max() + 0.01


@pytest.mark.parametrize("attention_backend", ["reference", "cpu"], ids=["xla", "cpu-kernels"])
def test_longrope_long_factors_past_the_original_context(hf_model_dir, attention_backend):
    """Where max_model_len passes original_max_position_embeddings, longrope runs on its long factors: as
    transformers does for a sequence past it (a 40-token prompt against 32), on both executors."""
    model_dir = hf_model_dir("phi3", original_max_position_embeddings=32)
    prompt = _prompts(3)[1][:32] + _prompts(4)[1][:8]
    (ours,) = jserve_logits(model_dir, [prompt], "float32", attention_backend)
    hf = load_hf(model_dir)
    np.testing.assert_allclose(ours, hf_logits(hf, prompt), atol=1e-4, rtol=0)
    # the short factors give other logits: the test tells the two sets apart
    assert np.abs(hf_logits(hf, prompt[:32]) - ours[:32]).max() > 1e-3


# YaRN: Qwen3's attention factor folds into its q/k norms (they follow the projections); the Llama takes DeepSeek's
# mscale ratio, its own betas and a ramp whose ends are not rounded (truncate false, as gpt-oss sets it).
YARN_CASES = {
    "qwen3": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}),
    "llama": dict(rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                                "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5,
                                "truncate": False}),
    # OLMo 3: YaRN on its full-attention layer only, its windowed layers unscaled (the factor folds into that
    # layer's q/k norms, which span all heads)
    "olmo3": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}),
    # DeepSeek-V3: the attention factor on the rotary rows of its latent attention only, and the scores scaled by
    # mscale(factor, mscale_all_dim) squared
    "deepseek_v3": dict(rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256,
                                      "mscale": 1.0, "mscale_all_dim": 0.7}),
}


@pytest.mark.parametrize("attention_backend", ["reference", "cpu"], ids=["xla", "cpu-kernels"])
@pytest.mark.parametrize("variant", list(YARN_CASES))
def test_yarn_logits_match_transformers(hf_model_dir, variant, attention_backend):
    """YaRN's frequencies and attention factor as transformers computes them, on both executors; the same weights
    without the scaling give other logits, so the test tells the two apart."""
    model_dir = hf_model_dir(variant, **YARN_CASES[variant])
    hf = load_hf(model_dir)
    prompts = _prompts()
    ours = jserve_logits(model_dir, prompts, "float32", attention_backend)
    for prompt, logits in zip(prompts, ours, strict=True):
        np.testing.assert_allclose(logits, hf_logits(hf, prompt), atol=1e-4, rtol=0)
    unscaled = load_hf(hf_model_dir(variant, **{**YARN_CASES[variant], "rope_scaling": {"rope_type": "default"}}))
    assert np.abs(hf_logits(unscaled, prompts[1]) - ours[1]).max() > 1e-3


def test_yarn_serves_its_original_context_times_its_factor(hf_model_dir):
    """vLLM's rule: a YaRN model's context is original_max_position_embeddings x factor where that passes
    max_position_embeddings (Qwen's long-context recipe adds rope_scaling and nothing else)."""
    config = ModelConfig.from_pretrained(hf_model_dir("qwen3", **YARN_CASES["qwen3"]))
    assert (config.rope_scaling.kind, config.max_position_embeddings) == ("yarn", 4096)
    assert ModelConfig.from_pretrained(hf_model_dir("qwen3")).max_position_embeddings == 2048


def test_sliding_window_is_exercised(hf_model_dir):
    """The mistral variant's window (12) is shorter than the longest prompt, so the window really matters."""
    windowed = load_hf(hf_model_dir("mistral"))
    unwindowed = load_hf(hf_model_dir("mistral", sliding_window=None))
    prompt = _prompts()[1]
    assert np.abs(hf_logits(windowed, prompt) - hf_logits(unwindowed, prompt)).max() > 1e-3


# Variants whose decode steps on the XLA path compute what their prefill does, which the float32 logits test checks
# there: the rest (windows, NoPE layers, experts) also decode through their own XLA paths (DeepSeek-V3's for the
# latent attention both DeepSeeks share).
PREFILL_CHECKS_XLA = {"llama3_rope", "llama_linear_rope", "qwen2", "qwen3", "granite", "gemma", "olmo2", "glm4",
                      "deepseek_v2", "granitemoe"}
# Mixtures of experts run the Flax model on both executors: their decode on the CPU layer executor's matmuls is
# checked on Qwen2-MoE (dense and expert layers, a shared expert) and DeepSeek-V2 (its latent attention in the C++
# attention); the others decode on the XLA path.
XLA_CHECKS_CPU = {"mixtral", "qwen3_moe", "glm4_moe", "olmoe", "gpt_oss", "deepseek_v3", "granitemoe",
                  "granitemoeshared"}
GREEDY_EXECUTORS = {"auto": "cpu-kernels", "reference": "xla"}


@pytest.mark.parametrize(("variant", "executor"), [
    pytest.param(v, e, id=f"{v}-{name}") for v in VARIANTS for e, name in GREEDY_EXECUTORS.items()
    if v not in (PREFILL_CHECKS_XLA if e == "reference" else XLA_CHECKS_CPU)])
def test_greedy_tokens_match_transformers(hf_model_dir, variant, llm_factory, executor):
    model_dir = hf_model_dir(variant)
    hf = load_hf(model_dir)
    prompts = _prompts(2)
    llm = llm_factory(model_dir, attention_backend=executor)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == hf_greedy(hf, prompt, 32)
        assert output.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("hidden_size", [1152, 2304, 2560, 3584, 3840, 5376])
def test_gemma_embedding_scale_is_rounded_as_transformers_rounds_it(hidden_size):
    """Gemma multiplies its embeddings by sqrt(hidden_size) in the model's dtype (Gemma 3's 1B-27B and Gemma 2's
    widths; the tiny variants' sqrt(64) is exact in bfloat16, so the parity tests cannot tell)."""
    from jserve.config import ModelConfig
    from jserve.models.layers import embedding_multiplier

    config = ModelConfig.from_hf_dict(dict(model_type="gemma3_text", vocab_size=512, hidden_size=hidden_size,
                                           intermediate_size=128, num_hidden_layers=2, num_attention_heads=4))
    scale = torch.tensor(hidden_size**0.5)  # Gemma3TextScaledWordEmbedding's embed_scale buffer
    for ours, theirs in ((jnp.bfloat16, torch.bfloat16), (jnp.float32, torch.float32)):
        assert embedding_multiplier(config, jnp.dtype(ours)) == scale.to(theirs).item()


def test_gemma3_image_text_checkpoint_serves_its_language_model(tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint (Gemma 3 4B-27B) loads its language model, the vision tower left
    unread: text logits equal transformers' own image-text model's, and its end-of-turn ids are kept."""
    import json

    import transformers
    from hf_models import build_gemma3_image_text

    from jserve.config import ModelConfig

    model_dir = build_gemma3_image_text(tmp_path / "gemma3-it")
    saved = json.loads((model_dir / "config.json").read_text())
    assert saved["model_type"] == "gemma3" and "text_config" in saved
    assert ModelConfig.from_pretrained(model_dir).eos_token_ids[:2] == (2, 5)
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32,
                                                                     attn_implementation="eager").eval()
    prompts = _prompts(5)
    logits = jserve_logits(model_dir, prompts, "float32")
    for prompt, ours in zip(prompts, logits, strict=True):
        np.testing.assert_allclose(ours, hf_logits(hf, prompt), atol=1e-4, rtol=0)
    # the same checkpoint under the names transformers' own classes use in memory (model.language_model.*,
    # model.vision_tower.*) loads alike
    from safetensors.numpy import load_file, save_file

    tensors = load_file(model_dir / "model.safetensors")
    assert any(name.startswith("vision_tower.") for name in tensors)
    renamed = {name.replace("language_model.model.", "model.language_model.", 1) if name.startswith("language_model.")
               else f"model.{name}": array for name, array in tensors.items()}
    save_file(renamed, str(model_dir / "model.safetensors"))
    for ours, theirs in zip(jserve_logits(model_dir, prompts, "float32"), logits, strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_mistral3_image_text_checkpoint_serves_its_language_model(tmp_path):
    """A Mistral3ForConditionalGeneration checkpoint (Mistral Small 3.1 / 3.2, Devstral and Magistral Small) loads
    its language model, the vision tower and projector left unread: text logits equal transformers' own image-text
    model's, and its end-of-turn ids are kept."""
    import json

    import transformers
    from hf_models import build_mistral3_image_text

    from jserve.config import ModelConfig

    model_dir = build_mistral3_image_text(tmp_path / "mistral3")
    saved = json.loads((model_dir / "config.json").read_text())
    assert saved["model_type"] == "mistral3" and saved["text_config"]["model_type"] == "mistral"
    config = ModelConfig.from_pretrained(model_dir)
    assert config.model_type == "mistral" and config.eos_token_ids == (2, 5) and not config.tie_word_embeddings
    hf = transformers.Mistral3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32,
                                                                      attn_implementation="eager").eval()
    prompts = _prompts(6)
    for prompt, ours in zip(prompts, jserve_logits(model_dir, prompts, "float32"), strict=True):
        np.testing.assert_allclose(ours, hf_logits(hf, prompt), atol=1e-4, rtol=0)


def test_llama4_image_text_checkpoint_serves_its_language_model(tmp_path):
    """A Llama4ForConditionalGeneration checkpoint (Llama 4 Scout, Maverick) loads its language model, the vision
    model and projector left unread: text logits equal transformers' own image-text model's."""
    import transformers
    from hf_models import build_llama4_image_text

    model_dir = build_llama4_image_text(tmp_path / "llama4")
    # its language model as transformers holds it (the image-text forward fails on text alone in transformers 5.24)
    hf = transformers.Llama4ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32,
                                                                     attn_implementation="eager").eval().language_model
    prompts = _prompts(6)
    for prompt, ours in zip(prompts, jserve_logits(model_dir, prompts, "float32"), strict=True):
        np.testing.assert_allclose(ours, hf_logits(hf, prompt), atol=1e-4, rtol=0)
