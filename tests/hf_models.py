"""Tiny random-weight Hugging Face checkpoints, built by transformers itself, for parity tests."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.numpy import load_file, save_file

VOCAB = 512

# Each variant exercises one family difference: GQA, rope scaling, sliding window, biases + tied
# embeddings, q/k norm; phi3: fused checkpoint tensors, partial rotary embedding, longrope (its short factors and
# attention factor up to original_max_position_embeddings) and a sliding window; granite: its four multipliers
# with tied embeddings; gemma: GELU, (1 + weight) norms, scaled embeddings, head_dim != hidden / heads; gemma2: its
# sandwich norms, both soft caps and a window on every other layer; gemma3: q/k norm, five windowed layers of six
# rotating by their own base, linear scaling on the global ones; smollm3: no rotary embedding in its NoPE layers
# (the second of two); mixtral: top-2 of 4 experts in every layer, renormalized; qwen2_moe: a dense first layer, then
# top-2 of 4 experts (not renormalized) beside a gated shared expert; qwen3_moe: top-3 of 8 experts renormalized,
# its middle layer dense (mlp_only_layers); glm4_moe (GLM-4.5): a dense first layer, then top-3 of 8 experts by
# sigmoid scores within the 2 best of 4 groups (a random correction bias), scaled by 2.5, beside 2 shared experts'
# worth of ungated columns; q/k/v biases, q/k norm and half the head rotated; olmo2: q/k norms over all heads, each
# block's output normalized and not its input; olmo3: those, with a window on three layers of four; olmoe: those q/k
# norms, q, k and v clipped, top-2 of 4 experts (not renormalized); glm4: interleaved rotary pairs over half the
# head, sandwich norms named its own way, q/k/v biases, a fused gate|up; gpt_oss: attention sinks, a window on every
# other layer, YaRN, top-2 of 4 experts weighted by the softmax of their logits, biases on the router and the experts,
# a SwiGLU clamped where the tiny model's activations reach; deepseek_v2: latent attention with a plain q_proj and
# interleaved rotary pairs, a dense first layer, then top-3 of 8 experts by softmax within the 2 best of 4 groups by
# their best score, scaled by 1.5, beside 2 shared experts' worth of ungated columns; deepseek_v3: latent attention
# with low-rank queries, experts chosen as GLM-4.5's; granitemoe: Granite's four multipliers on top-2 of 4 experts
# stacked as Granite stores them; granitemoeshared: those with an ungated shared MLP and tied embeddings; llama4:
# a dense layer then a MoE one (top-1 of 4 experts, their inputs scaled, a shared expert), interleaved rotary with
# q/k L2 norms on three layers, attending within chunks of 16 positions, the fourth NoPE with its query temperature
# (floor_scale 4 and the chunk so small that short prompts reach them).
VARIANTS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(num_key_value_heads=2)),
    "llama3_rope": ("LlamaConfig", dict(num_key_value_heads=2, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, rope_theta=500000.0)),
    "llama_linear_rope": ("LlamaConfig", dict(num_key_value_heads=4, rope_scaling={
        "rope_type": "linear", "factor": 2.0})),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=12)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=16)),
    "phi3": ("Phi3Config", dict(num_key_value_heads=2, partial_rotary_factor=0.5, sliding_window=16,
                                original_max_position_embeddings=1024, rope_scaling={
                                    "rope_type": "longrope", "short_factor": [1.0, 1.3, 1.7, 2.2],
                                    "long_factor": [1.5, 3.0, 6.0, 12.0]})),
    "granite": ("GraniteConfig", dict(num_key_value_heads=2, tie_word_embeddings=True, embedding_multiplier=6.0,
                                      attention_multiplier=0.15, residual_multiplier=0.3, logits_scaling=4.0)),
    "gemma": ("GemmaConfig", dict(num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)),
    "gemma2": ("Gemma2Config", dict(num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=12,
                                    attn_logit_softcapping=3.0, final_logit_softcapping=4.0, tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", dict(num_key_value_heads=2, head_dim=16, num_hidden_layers=7, sliding_window=12,
                                        rope_parameters={
                                            "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                               "rope_theta": 100000.0},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}},
                                        tie_word_embeddings=True)),
    "smollm3": ("SmolLM3Config", dict(num_key_value_heads=2, no_rope_layer_interval=2, tie_word_embeddings=True)),
    "mixtral": ("MixtralConfig", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=48, shared_expert_intermediate_size=96,
                                         decoder_sparse_step=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_key_value_heads=2, head_dim=16, num_hidden_layers=3, num_experts=8,
                                         num_experts_per_tok=3, moe_intermediate_size=48, norm_topk_prob=True,
                                         mlp_only_layers=[1])),
    "glm4_moe": ("Glm4MoeConfig", dict(num_key_value_heads=2, head_dim=16, num_hidden_layers=3, attention_bias=True,
                                       use_qk_norm=True, partial_rotary_factor=0.5, n_routed_experts=8,
                                       num_experts_per_tok=3, moe_intermediate_size=48, n_shared_experts=2,
                                       first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                       norm_topk_prob=True)),
    "olmo2": ("Olmo2Config", dict(num_key_value_heads=2)),
    "olmo3": ("Olmo3Config", dict(num_key_value_heads=2, num_hidden_layers=4, sliding_window=12)),
    "glm4": ("Glm4Config", dict(num_key_value_heads=2, head_dim=16)),
    "olmoe": ("OlmoeConfig", dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, clip_qkv=1.5)),
    "gpt_oss": ("GptOssConfig", dict(num_key_value_heads=2, head_dim=16, sliding_window=12, num_local_experts=4,
                                     num_experts_per_tok=2, intermediate_size=48, swiglu_limit=0.6)),
    "deepseek_v2": ("DeepseekV2Config", dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
                                             qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=12,
                                             n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=48,
                                             n_shared_experts=2, first_k_dense_replace=1, n_group=4, topk_group=2,
                                             topk_method="group_limited_greedy", routed_scaling_factor=1.5)),
    "granitemoe": ("GraniteMoeConfig", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                            intermediate_size=48, embedding_multiplier=6.0, attention_multiplier=0.15,
                                            residual_multiplier=0.3, logits_scaling=4.0)),
    "granitemoeshared": ("GraniteMoeSharedConfig", dict(num_key_value_heads=2, num_local_experts=4,
                                                        num_experts_per_tok=2, intermediate_size=48,
                                                        shared_intermediate_size=96, embedding_multiplier=6.0,
                                                        attention_multiplier=0.15, residual_multiplier=0.3,
                                                        logits_scaling=4.0, tie_word_embeddings=True)),
    "llama4": ("Llama4TextConfig", dict(num_key_value_heads=2, head_dim=16, num_hidden_layers=4, intermediate_size=48,
                                        intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=1,
                                        interleave_moe_layer_step=2, floor_scale=4, attn_scale=0.5,
                                        attention_chunk_size=16)),
    "deepseek_v3": ("DeepseekV3Config", dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24,
                                             qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=12,
                                             n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=48,
                                             n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
                                             routed_scaling_factor=2.5)),
}

_MODEL_CLASSES = {"LlamaConfig": "LlamaForCausalLM", "MistralConfig": "MistralForCausalLM",
                  "Qwen2Config": "Qwen2ForCausalLM", "Qwen3Config": "Qwen3ForCausalLM",
                  "Phi3Config": "Phi3ForCausalLM", "GraniteConfig": "GraniteForCausalLM",
                  "GemmaConfig": "GemmaForCausalLM", "Gemma2Config": "Gemma2ForCausalLM",
                  "Gemma3TextConfig": "Gemma3ForCausalLM", "SmolLM3Config": "SmolLM3ForCausalLM",
                  "MixtralConfig": "MixtralForCausalLM", "Qwen2MoeConfig": "Qwen2MoeForCausalLM",
                  "Qwen3MoeConfig": "Qwen3MoeForCausalLM", "Glm4MoeConfig": "Glm4MoeForCausalLM",
                  "Olmo2Config": "Olmo2ForCausalLM", "Olmo3Config": "Olmo3ForCausalLM",
                  "Glm4Config": "Glm4ForCausalLM", "OlmoeConfig": "OlmoeForCausalLM",
                  "GptOssConfig": "GptOssForCausalLM", "DeepseekV2Config": "DeepseekV2ForCausalLM",
                  "DeepseekV3Config": "DeepseekV3ForCausalLM", "GraniteMoeConfig": "GraniteMoeForCausalLM",
                  "GraniteMoeSharedConfig": "GraniteMoeSharedForCausalLM", "Llama4TextConfig": "Llama4ForCausalLM"}


def make_config(variant: str, **overrides) -> transformers.PretrainedConfig:
    config_cls, extra = VARIANTS[variant]
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    kwargs.update(extra)
    kwargs.update(overrides)
    return getattr(transformers, config_cls)(**kwargs)


def build_model(variant: str, out_dir: Path, seed: int = 0, **overrides) -> Path:
    """Save a random-weight model of `variant` to out_dir (float32 safetensors) and return the path."""
    config = make_config(variant, **overrides)
    torch.manual_seed(seed)
    return _save_random(getattr(transformers, _MODEL_CLASSES[type(config).__name__])(config), out_dir)


def _save_random(model: torch.nn.Module, out_dir: Path, norms: tuple[float, float] = (0.8, 1.2)) -> Path:
    """Fill a transformers model with larger-than-default random weights, so that logits differ visibly between
    tokens, and save it (float32 safetensors): matrices and stacks of experts' matrices normal(0, 0.08), norm weights
    uniform over `norms`, attention sinks normal(0, 1), the rest normal(0, 0.05), GLM-4.5's router bias (a buffer,
    zeros as transformers makes it) normal(0, 0.1)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.08)
            elif "norm" in name:
                p.uniform_(*norms)
            elif name.endswith("sinks"):  # gpt-oss: logits as large as the scores, so that they weigh visibly
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    return Path(out_dir)


_FP4_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [..., in] -> MXFP4 (blocks uint8 [..., in / 32, 16], scales uint8 [..., in / 32]) as OpenAI's
    checkpoints store it: each block of 32 scaled by the power of two that brings its largest magnitude within
    E2M1's 6, each value rounded to the nearest E2M1 value, two a byte with the first in the low nibble."""
    groups = w.reshape(*w.shape[:-1], -1, 32).astype(np.float32)
    amax = np.abs(groups).max(-1, keepdims=True)
    exp = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).astype(np.int32)
    scaled = groups / np.ldexp(np.float32(1.0), exp)
    nibbles = np.abs(np.abs(scaled)[..., None] - _FP4_MAGNITUDES).argmin(-1).astype(np.uint8)
    nibbles |= (scaled < 0).astype(np.uint8) << 3
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4), (exp[..., 0] + 127).astype(np.uint8)


def build_gpt_oss_mxfp4(out_dir: Path, seed: int = 0, **overrides) -> Path:
    """The tiny gpt-oss with its experts' matrices in MXFP4, as OpenAI publishes gpt-oss (quantization_config
    mxfp4, `<name>_blocks` / `<name>_scales` [E, out, ...])."""
    out_dir = Path(out_dir)
    # MXFP4 rows: whole blocks of 32
    src = build_model("gpt_oss", out_dir / "float", seed, **{"intermediate_size": 64, **overrides})
    tensors = {}
    for name, value in load_file(src / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # stored [E, in, out]
            tensors[name + "_blocks"], tensors[name + "_scales"] = quantize_mxfp4(value.transpose(0, 2, 1))
        else:
            tensors[name] = value
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


_FP8_PROJECTION = re.compile(r"model\.layers\.\d+\..*_proj(_with_mqa)?\.weight$")


def quantize_fp8(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (float8_e4m3fn [out, in], float32 scales) with w ~= q * scale: one scale a block of
    block[0] x block[1] (the grid rounded up, its last blocks partial), or one a row where block is None; each scale
    brings its block's largest magnitude to e4m3's 448."""
    bm, bn = block or (1, w.shape[1])
    rows, cols = w.shape
    grid = (-(-rows // bm), -(-cols // bn))
    padded = torch.zeros(grid[0] * bm, grid[1] * bn)
    padded[:rows, :cols] = w.float()
    blocks = padded.reshape(grid[0], bm, grid[1], bn)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp_min(1e-12)
    q = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:rows, :cols].to(torch.float8_e4m3fn)
    return q, scale


def build_fp8_checkpoint(src: Path, out_dir: Path, block: tuple[int, int] | None = (128, 128),
                         layout: str = "fp8", strategy: str = "block") -> Path:
    """An FP8 copy of a float checkpoint, every decoder projection float8_e4m3fn with its scales: layout "fp8" as
    Hugging Face's FineGrainedFP8 (DeepSeek-V3, Qwen3-*-FP8) stores it (`weight_scale_inv` a block, the router and
    LM head in float), or "compressed-tensors" as llm-compressor's FP8 (`weight_scale` a block, a row or a tensor,
    by strategy; dynamic per-token activation quantization declared, or for a tensor's scale static activation
    scales stored)."""
    from safetensors.torch import load_file as load_torch
    from safetensors.torch import save_file as save_torch

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True)
    for f in Path(src).iterdir():
        if f.name != "model.safetensors":
            (out_dir / f.name).write_bytes(f.read_bytes())
    tensors = {}
    for name, w in load_torch(str(Path(src) / "model.safetensors")).items():
        if not _FP8_PROJECTION.match(name):
            tensors[name] = w
            continue
        base = name[:-len(".weight")]
        if strategy == "tensor":  # static activation scales too, as llm-compressor's FP8 (not dynamic) stores them
            scale = (w.abs().max() / 448.0).reshape(1)
            tensors[name], tensors[base + ".weight_scale"] = (w / scale).to(torch.float8_e4m3fn), scale
            tensors[base + ".input_scale"] = torch.full((1,), 0.01)
        else:
            q, scale = quantize_fp8(w, block if strategy == "block" else None)
            key = ".weight_scale_inv" if layout == "fp8" else ".weight_scale"
            tensors[name], tensors[base + key] = q, scale.contiguous()
    save_torch(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((Path(src) / "config.json").read_text())
    if layout == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                         "weight_block_size": list(block)}
    else:
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False}
        if strategy == "block":
            weights["block_structure"] = list(block)
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": {
                "num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor" if strategy == "tensor"
                else "token", "dynamic": strategy != "tensor"}}}}
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """What an FP8 weight stands for, as DeepSeek's weight_dequant computes it: q * the scale of its block."""
    if scale.numel() == 1:
        return q.float() * scale.reshape(())
    bm, bn = block or (1, q.shape[1])
    rows, cols = q.shape
    return q.float() * scale.float().repeat_interleave(bm, 0)[:rows].repeat_interleave(bn, 1)[:, :cols]


def load_hf(path: Path, dtype: torch.dtype = torch.float32):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    return model.eval()


_TOKENIZER_TEXT = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. Hello, world! 你好，世界。 Ünïcödé 🙂🚀",
    "import os\nimport sys\n\nclass Engine:\n    def step(self):\n        return [x * 2 for x in range(10)]\n",
]


def save_tokenizer(out_dir: Path) -> Path:
    """A byte-level BPE tokenizer with fewer than VOCAB tokens and a ChatML template, saved to out_dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_TOKENIZER_TEXT * 4, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        chat_template=("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                       "{% if add_generation_prompt %}<s>assistant\n"
                       # a template variable, as Qwen3's enable_thinking: what chat_template_kwargs set
                       "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
                       # gpt-oss's reasoning_effort, which the request field of that name sets
                       "{% if reasoning_effort is defined %}effort {{ reasoning_effort }}\n{% endif %}"
                       "{% endif %}"))
    fast.save_pretrained(out_dir)
    return Path(out_dir)


def build_gemma3_image_text(out_dir: Path, seed: int = 0) -> Path:
    """A tiny Gemma3ForConditionalGeneration (the 4B-27B checkpoints' class): the gemma3 variant's language model
    beside a one-layer vision tower, saved as transformers saves it."""
    text = make_config("gemma3").to_dict()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2,
                                       image_token_index=VOCAB - 1, eos_token_id=[2, 5])
    torch.manual_seed(seed)
    # norm weights near 0: Gemma multiplies by (1 + weight)
    return _save_random(transformers.Gemma3ForConditionalGeneration(config), out_dir, norms=(-0.2, 0.2))


def build_mistral3_image_text(out_dir: Path, seed: int = 0) -> Path:
    """A tiny Mistral3ForConditionalGeneration (Mistral Small 3.1 / 3.2's class): the mistral variant's language
    model (its window off, as those checkpoints have it) beside a one-layer Pixtral vision tower, untied."""
    text = {**make_config("mistral", sliding_window=None).to_dict(), "model_type": "mistral"}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
                  image_size=28, patch_size=14)
    config = transformers.Mistral3Config(text_config=text, vision_config=vision, image_token_index=VOCAB - 1,
                                         tie_word_embeddings=False, eos_token_id=[2, 5])
    torch.manual_seed(seed)
    return _save_random(transformers.Mistral3ForConditionalGeneration(config), out_dir)


def build_llama4_image_text(out_dir: Path, seed: int = 0) -> Path:
    """A tiny Llama4ForConditionalGeneration (Llama 4 Scout's and Maverick's class): the llama4 variant's language
    model beside a one-layer vision model."""
    text = {**make_config("llama4").to_dict(), "model_type": "llama4_text"}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    config = transformers.Llama4Config(text_config=text, vision_config=vision, image_token_index=VOCAB - 1)
    torch.manual_seed(seed)
    return _save_random(transformers.Llama4ForConditionalGeneration(config), out_dir)
