"""Llama 4's config.json (Llama4ForCausalLM, model_type llama4_text; and Llama4ForConditionalGeneration's text_config)
as ModelConfig fields.

Every layer in `moe_layers` (transformers' default: every interleave_moe_layer_step-th) is a mixture of experts
whose router picks its top num_experts_per_tok experts and scales each one's *input* by the sigmoid of its logit, beside
an ungated shared expert; the experts and the shared expert are intermediate_size wide, the dense layers
intermediate_size_mlp. The layers of no_rope_layers (1: rotary, 0: NoPE; default every fourth without) rotate q and
k by interleaved pairs and then L2-normalize them per head (use_qk_norm); the NoPE layers scale their queries by
log1p(floor((position + 1) / floor_scale)) * attn_scale + 1 (attn_temperature_tuning). The layers layer_types calls
chunked_attention (default: the rotary ones) attend within chunks of attention_chunk_size positions.
"""

from __future__ import annotations

from jserve.config_json import ModelLoadError, positive_float, positive_int


def llama4_text_config(cfg: dict) -> dict:
    """The language model of a Llama 4 image-text checkpoint as its own config (its text_config, with the
    checkpoint's ids where the text_config has none). jserve serves its text; the vision model is left unread."""
    top = {key: cfg[key] for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings") if key in cfg}
    return {**top, **cfg["text_config"], "model_type": "llama4_text"}


def llama4_config(cfg: dict, source: str) -> dict:
    """config.json's fields as the Llama family reads them: the dense layers' width as intermediate_size."""
    return {**cfg, "intermediate_size": positive_int(cfg, "intermediate_size_mlp", source, 16384),
            "moe_intermediate_size": positive_int(cfg, "intermediate_size", source, 8192)}


def llama4_fields(cfg: dict, source: str) -> dict:
    """The ModelConfig fields of a llama4_text config already read by llama4_config."""
    if cfg.get("model_type") != "llama4_text":
        return {}
    layers = positive_int(cfg, "num_hidden_layers", source)
    experts = positive_int(cfg, "num_local_experts", source, 16)
    per_token = positive_int(cfg, "num_experts_per_tok", source, 1)
    if per_token > experts:
        raise ModelLoadError(f"{source}: num_experts_per_tok ({per_token}) exceeds the {experts} experts")
    step = positive_int(cfg, "interleave_moe_layer_step", source, 1)
    moe = cfg.get("moe_layers")
    moe = list(range(step - 1, layers, step)) if moe is None else moe
    rope = cfg.get("no_rope_layers")
    if rope is None or rope == []:
        interval = positive_int(cfg, "no_rope_layer_interval", source, 4)
        rope = [int((i + 1) % interval != 0) for i in range(layers)]
    if not isinstance(moe, list) or not all(isinstance(i, int) and 0 <= i < layers for i in moe):
        raise ModelLoadError(f"{source}: moe_layers must list layer indices below {layers}, got {moe!r}")
    if not isinstance(rope, list) or len(rope) != layers or not all(f in (0, 1) for f in rope):
        raise ModelLoadError(f"{source}: no_rope_layers must list {layers} flags (1: rotary embedding, 0: none), got "
                             f"{rope!r}")
    tuning = cfg.get("attn_temperature_tuning", True)
    width = cfg["moe_intermediate_size"]
    kinds = cfg.get("layer_types") or ["chunked_attention" if f else "full_attention" for f in rope]
    if not isinstance(kinds, list) or len(kinds) != layers or \
            not all(k in ("chunked_attention", "full_attention") for k in kinds):
        raise ModelLoadError(f"{source}: layer_types must list {layers} of chunked_attention and full_attention, got "
                             f"{kinds!r}")
    return {"num_experts": experts, "num_experts_per_tok": per_token, "moe_routing": "sigmoid_input",
            "moe_intermediate_size": width, "shared_expert_intermediate_size": width, "shared_expert_gated": False,
            "moe_layers": tuple(i in moe for i in range(layers)), "rope_layers": tuple(bool(f) for f in rope),
            "rotary_interleaved": True, "qk_l2_norm": bool(cfg.get("use_qk_norm", True)),
            "attention_temperature": (positive_float(cfg.get("floor_scale", 8192), "floor_scale", source),
                                      float(cfg.get("attn_scale", 0.1))) if tuning else None,
            "attention_chunk_size": positive_int(cfg, "attention_chunk_size", source, 8192),
            "chunked_layers": tuple(k == "chunked_attention" for k in kinds)}
