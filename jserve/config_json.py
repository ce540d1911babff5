"""A Hugging Face config.json's fields as ModelConfig's (jserve.config): each family's keys, transformers' defaults
where a file leaves one out, and an error naming the file and field for anything jserve cannot run."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from checkpoints import CheckpointError as ModelLoadError

GEMMA_TYPES = ("gemma", "gemma2", "gemma3_text")
# The MLP activations (config.json's names): SiLU, and the tanh approximation of GELU (Gemma's; its first
# checkpoints say "gelu", which transformers reads as the tanh approximation too).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling. kind is "default", "linear", "llama3", "freq_factors" (each frequency
    divided by its own factor: how a GGUF file stores Llama 3's scaling, as llama.cpp's rope_freqs tensor),
    "longrope" (Phi-3's: each frequency divided by a short or a long factor, and q and k scaled by
    attention_factor) or "yarn" (each frequency between its own and its interpolated value by where its wavelength
    falls between beta_fast and beta_slow turns over the original context, and q and k scaled by attention_factor)."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] = ()  # kind "freq_factors": one per rotary frequency (rotary_dim / 2)
    # kind "longrope": the factors for contexts up to original_max_position_embeddings and past it. transformers
    # picks a set per forward pass by the sequence's length; a served model picks one for its max_model_len
    # (ModelConfig.for_context), so that every cached key of a sequence is rotated alike.
    short_factors: tuple[float, ...] = ()
    long_factors: tuple[float, ...] = ()
    use_long_factors: bool = False
    attention_factor: float = 1.0  # multiplies the rotated dimensions of q and k (folded into their weights at load)
    # kind "yarn": frequencies turning more than beta_fast times over the original context keep their value, those
    # turning fewer than beta_slow times are divided by factor, a linear ramp between; truncate rounds the ramp's
    # ends to whole dimensions (transformers' default; gpt-oss turns it off).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


_REQUIRED = object()


def positive_int(cfg: dict, key: str, source: str, default: object = _REQUIRED) -> int:
    """cfg[key] as a positive integer; a missing or null optional field takes `default`. Anything else (a string, a
    bool, a float, zero or less) raises ModelLoadError naming the file and the field, before it reaches array
    shapes and kernels where it would fail without saying where it came from."""
    if default is _REQUIRED:
        value = cfg[key]  # KeyError: the caller reports the missing field
    else:
        value = cfg.get(key)
        if value is None:
            return default  # type: ignore[return-value]
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ModelLoadError(f"{source}: {key} must be a positive integer, got {value!r}")
    return int(value)


def positive_float(value: object, key: str, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
        raise ModelLoadError(f"{source}: {key} must be a positive number, got {value!r}")
    return float(value)


def rope_param(cfg: dict, key: str, default):
    # transformers >= 5 nests rope settings under "rope_parameters"; older configs keep them at the top level.
    params = cfg.get("rope_parameters") or {}
    return params.get(key, cfg.get(key, default))


def rope_scaling(cfg: dict, source: str) -> RopeScaling:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if cfg.get("model_type") == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"  # Phi-3's early configs' names for it (transformers' Phi3Config reads them so)
    if kind == "default":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(scaling["factor"]))
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
        )
    if kind == "longrope":
        return _longrope(cfg, scaling, source)
    if kind == "yarn":
        return _yarn(cfg, scaling, source)
    raise ModelLoadError(f"{source}: rope scaling type {kind!r} is not supported (default, linear, llama3, "
                         "longrope, yarn)")


def _yarn(cfg: dict, scaling: dict, source: str) -> RopeScaling:
    """YaRN with transformers' defaults (_compute_yarn_parameters, standardize_rope_params):
    original_max_position_embeddings from the config's top level (Phi-3 keeps it there, and transformers prefers
    it), else the scaling dict, else max_position_embeddings; factor, where not given, max_position_embeddings over it;
    attention_factor, where not given, 0.1 ln(factor) + 1, or DeepSeek's ratio of that with mscale to that with
    mscale_all_dim where both are set; beta_fast 32 and beta_slow 1 where unset or zero."""
    original = cfg.get("original_max_position_embeddings", scaling.get("original_max_position_embeddings"))
    if original is None:
        original = positive_int(cfg, "max_position_embeddings", source, 2048)
    original = positive_int({"original_max_position_embeddings": original}, "original_max_position_embeddings",
                            source)
    factor = scaling.get("factor")
    if factor is None:
        factor = positive_int(cfg, "max_position_embeddings", source, 2048) / original
    factor = positive_float(factor, "rope factor", source)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    truncate = scaling.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ModelLoadError(f"{source}: rope truncate must be true or false, got {truncate!r}")
    return RopeScaling(kind="yarn", factor=factor, original_max_position_embeddings=original,
                       attention_factor=positive_float(attention_factor, "rope attention_factor", source),
                       beta_fast=positive_float(scaling.get("beta_fast") or 32.0, "rope beta_fast", source),
                       beta_slow=positive_float(scaling.get("beta_slow") or 1.0, "rope beta_slow", source),
                       truncate=truncate)


def _longrope(cfg: dict, scaling: dict, source: str) -> RopeScaling:
    """Phi-3's longrope, with transformers' defaults: original_max_position_embeddings from the scaling dict or the
    config's top level; attention_factor, where not given, sqrt(1 + ln(factor) / ln(original)) with factor
    max_position_embeddings / original (or the dict's own factor)."""
    original = scaling.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    original = positive_int({"original_max_position_embeddings": original}, "original_max_position_embeddings",
                             source)
    half = rotary_dim(cfg, _head_dim(cfg, source), source) // 2
    factors = {}
    for key in ("short_factor", "long_factor"):
        values = scaling.get(key)
        if not isinstance(values, list) or len(values) != half or \
                not all(isinstance(v, numbers.Real) and not isinstance(v, bool) and v > 0 for v in values):
            raise ModelLoadError(f"{source}: longrope {key} must be a list of {half} positive numbers (one per "
                                 f"rotary frequency), got {values!r}")
        factors[key] = tuple(float(v) for v in values)
    factor = scaling.get("factor")
    if factor is None:
        factor = positive_int(cfg, "max_position_embeddings", source, 2048) / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(kind="longrope", factor=float(factor), original_max_position_embeddings=original,
                       short_factors=factors["short_factor"], long_factors=factors["long_factor"],
                       attention_factor=positive_float(attention_factor, "rope attention_factor", source))


def activation(cfg: dict, source: str) -> str:
    """The MLP activation: Gemma 2 and 3 name it hidden_activation, Gemma's first checkpoints say "gelu" for the
    tanh approximation (as transformers reads them)."""
    gemma = cfg.get("model_type") in GEMMA_TYPES
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
    if gemma and act in ("gelu", "gelu_tanh"):
        act = "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise ModelLoadError(f"{source}: hidden activation {act!r} is not supported ({', '.join(ACTIVATIONS)})")
    return act


def smollm3_rope_layers(cfg: dict, source: str) -> dict:
    """SmolLM3's no_rope_layers (1: the layer rotates q and k, 0: NoPE), else transformers' default: every
    no_rope_layer_interval-th layer (4) without rotary embedding."""
    if cfg.get("model_type") != "smollm3":
        return {}
    num_layers = positive_int(cfg, "num_hidden_layers", source)
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = positive_int(cfg, "no_rope_layer_interval", source, 4)
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if not isinstance(flags, list) or len(flags) != num_layers or not all(f in (0, 1) for f in flags):
        raise ModelLoadError(f"{source}: no_rope_layers must list {num_layers} flags (1: rotary embedding, 0: none), "
                             f"got {flags!r}")
    return {"rope_layers": tuple(bool(f) for f in flags)}


# transformers' Gemma3TextConfig defaults: the text_config of Gemma 3's image-text checkpoints (4B, 12B, 27B) lists
# only the fields that differ from them.
GEMMA3_TEXT_DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131_072,
                            rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=4096,
                            hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, bos_token_id=2,
                            eos_token_id=1)


def gemma3_text_config(cfg: dict) -> dict:
    """The language model of a Gemma 3 image-text checkpoint (Gemma3ForConditionalGeneration) as a Gemma 3 text
    config: its text_config over transformers' defaults, with the checkpoint's own end-of-turn ids. jserve serves its
    text; the vision tower's weights are left unread."""
    top = {key: cfg[key] for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings") if key in cfg}
    return {**GEMMA3_TEXT_DEFAULTS, **top, **cfg["text_config"], "model_type": "gemma3_text"}


def mistral3_text_config(cfg: dict) -> dict:
    """The language model of a Mistral 3 image-text checkpoint (Mistral3ForConditionalGeneration: Mistral Small 3.1
    and 3.2, Devstral Small, Magistral Small) as its own config: the text_config (a Mistral), with the checkpoint's
    end-of-turn ids and its top-level tie_word_embeddings where it states one (transformers 5 ties by it). jserve
    serves its text; the vision tower and projector are left unread."""
    top = {key: cfg[key] for key in ("eos_token_id", "bos_token_id") if key in cfg}
    tie = {"tie_word_embeddings": cfg["tie_word_embeddings"]} if "tie_word_embeddings" in cfg else {}
    return {"model_type": "mistral", **top, **cfg["text_config"], **tie}


def layer_type_rope(cfg: dict, source: str, theta: float, local_theta: float | None) -> dict:
    """Two rotary settings, one per layer type (Gemma 3, OLMo 3), as the fields the other families use: rope_theta
    and rope_scaling for the full-attention layers, rope_local_base_freq (no scaling) for the windowed ones.
    transformers >= 5 writes them as rope_parameters per layer type; older configs keep rope_theta / rope_scaling
    (and Gemma 3's rope_local_base_freq) at the top level. theta, local_theta: the family's defaults (None: the
    windowed layers rotate by rope_theta)."""
    cfg = dict(cfg)
    params = cfg.get("rope_parameters")
    local = {}
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError(f"{source}: rope scaling {local.get('rope_type')!r} of the sliding-window layers is "
                                 "not supported (only 'default')")
        cfg["rope_parameters"] = full
        cfg["rope_theta"] = full.get("rope_theta", theta)
    else:
        cfg.setdefault("rope_theta", theta)
    local_default = cfg["rope_theta"] if local_theta is None else local_theta
    cfg["rope_local_base_freq"] = local.get("rope_theta", cfg.get("rope_local_base_freq", local_default))
    return cfg


OLMO_TYPES = ("olmo2", "olmo3", "olmoe")


def olmo_fields(cfg: dict, source: str) -> dict:
    """OLMo 2 / OLMo 3 / OLMoE's differences as ModelConfig fields; none for another family. All three normalize q
    and k over all their heads; OLMo 2 and 3 normalize each block's output and not its input; OLMoE may clip q, k
    and v (clip_qkv). OLMo 3 windows the layers its layer_types mark "sliding_attention" (by default three of each
    four: every fourth attends to all positions); those rotate by rope_theta unscaled, as transformers' Olmo3Config
    applies rope scaling (YaRN in the long-context checkpoints) to the full-attention layers only."""
    model_type = cfg.get("model_type")
    if model_type not in OLMO_TYPES:
        return {}
    fields: dict = {"qk_norm_across_heads": True, "post_norms": model_type != "olmoe"}
    if cfg.get("clip_qkv") is not None:
        fields["clip_qkv"] = positive_float(cfg["clip_qkv"], "clip_qkv", source)
    if model_type == "olmo3" and sliding_window(cfg, source) is not None:
        num_layers = positive_int(cfg, "num_hidden_layers", source)
        layer_types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 4 else "full_attention"
                                                 for i in range(num_layers)]
        fields["sliding_layers"] = _sliding_layers(layer_types, num_layers, source)
        fields["local_rope_theta"] = positive_float(cfg["rope_local_base_freq"], "sliding_attention rope_theta",
                                                    source)
    return fields


def gemma_fields(cfg: dict, hidden: int, source: str) -> dict:
    """Gemma's differences as ModelConfig fields (transformers' defaults where config.json leaves one out); none
    for another family. Gemma 2 windows every other layer (even indices), Gemma 3 five of every six, each as its
    layer_types say where given."""
    model_type = cfg.get("model_type")
    if model_type not in GEMMA_TYPES:
        return {}
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{source}: use_bidirectional_attention (an embedding model) is not supported: jserve "
                             "serves causal language models")
    fields = {"embedding_multiplier": math.sqrt(hidden), "norm_weight_offset": 1.0}
    if model_type == "gemma":
        return fields
    scalar = positive_float(cfg.get("query_pre_attn_scalar", 256), "query_pre_attn_scalar", source)
    fields.update(attention_multiplier=scalar**-0.5, sandwich_norms=True)
    defaults = {"gemma2": (50.0, 30.0), "gemma3_text": (None, None)}[model_type]
    for key, default in zip(("attn_logit_softcapping", "final_logit_softcapping"), defaults, strict=True):
        value = cfg.get(key, default)
        fields[key] = None if value is None else positive_float(value, key, source)
    num_layers = positive_int(cfg, "num_hidden_layers", source)
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        pattern = 2 if model_type == "gemma2" else cfg.get("sliding_window_pattern", 6)
        pattern = positive_int({"sliding_window_pattern": pattern}, "sliding_window_pattern", source)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    fields["sliding_layers"] = _sliding_layers(layer_types, num_layers, source)
    if model_type == "gemma3_text":
        fields["local_rope_theta"] = positive_float(cfg["rope_local_base_freq"], "rope_local_base_freq", source)
    return fields


def _sliding_layers(layer_types: object, num_layers: int, source: str) -> tuple[bool, ...]:
    kinds = ("sliding_attention", "full_attention")
    if not isinstance(layer_types, list) or len(layer_types) != num_layers or \
            not all(kind in kinds for kind in layer_types):
        raise ModelLoadError(f"{source}: layer_types must list {num_layers} layer kinds, each one of {kinds}, got "
                             f"{layer_types!r}")
    return tuple(kind == "sliding_attention" for kind in layer_types)


def granite_multipliers(cfg: dict, source: str) -> dict:
    """Granite's four multipliers as ModelConfig fields (transformers' GraniteConfig defaults: 1.0 each); none for
    another family."""
    if cfg.get("model_type") not in ("granite", "granitemoe", "granitemoeshared"):
        return {}
    return {key: positive_float(cfg.get(key, 1.0), key, source)
            for key in ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")}


def _head_dim(cfg: dict, source: str) -> int:
    num_heads = positive_int(cfg, "num_attention_heads", source)
    return positive_int(cfg, "head_dim", source, positive_int(cfg, "hidden_size", source) // num_heads)


def rotary_dim(cfg: dict, head_dim: int, source: str) -> int | None:
    """The rotated dimensions of a head under partial_rotary_factor (top level or in rope_parameters), as
    transformers computes them; None for the whole head. Both the rotated and the passed-through dimensions must
    be even in number (they are rotated and passed in pairs)."""
    factor = rope_param(cfg, "partial_rotary_factor", None)
    if factor is None or factor == 1.0:
        return None
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not 0 < factor <= 1:
        raise ModelLoadError(f"{source}: partial_rotary_factor must be in (0, 1], got {factor!r}")
    dim = int(head_dim * factor + 1e-6)  # as transformers' int(head_dim * factor), safe from 95.99999 for 96
    if dim < 2 or dim % 2 or (head_dim - dim) % 2:
        raise ModelLoadError(f"{source}: partial_rotary_factor {factor} rotates {dim} of {head_dim} head dimensions; "
                             "jserve needs an even number rotated and an even number passed through")
    return None if dim == head_dim else dim


# transformers' Qwen2Config/Qwen3Config default: with use_sliding_window, layers at index >= 28 use the window.
QWEN_DEFAULT_MAX_WINDOW_LAYERS = 28


def sliding_window(cfg: dict, source: str = "config.json") -> int | None:
    """The sliding window of the layers that use one, or None. A window as long as the model's context never hides
    a key (Phi-3.5 and Phi-4-mini say 262144 for 131072 positions): None, so the attention kernels skip the
    window's masks. Qwen2/Qwen3 and SmolLM3 window only with use_sliding_window (which layers: windowed_layers)."""
    if not cfg.get("sliding_window") or cfg.get("model_type") == "gemma":
        return None
    if cfg.get("model_type") in _USE_SLIDING_WINDOW_TYPES and not cfg.get("use_sliding_window", False):
        return None
    window = positive_int(cfg, "sliding_window", source)
    if isinstance(cfg.get("max_position_embeddings"), int) and window >= cfg["max_position_embeddings"]:
        return None
    return window


# Families whose sliding_window applies only with use_sliding_window, to the layers transformers marks.
_USE_SLIDING_WINDOW_TYPES = ("qwen2", "qwen3", "smollm3", "qwen2_moe", "qwen3_moe")


def windowed_layers(cfg: dict, source: str) -> dict:
    """Qwen2/Qwen3 and SmolLM3 window the layers transformers marks "sliding_attention": `layer_types`, else (Qwen)
    those at index >= `max_window_layers` or (SmolLM3) its NoPE layers."""
    if cfg.get("model_type") not in _USE_SLIDING_WINDOW_TYPES or sliding_window(cfg, source) is None:
        return {}
    num_layers = positive_int(cfg, "num_hidden_layers", source)
    layer_types = cfg.get("layer_types")
    if layer_types is None and cfg.get("model_type") == "smollm3":
        rotates = smollm3_rope_layers(cfg, source)["rope_layers"]
        layer_types = ["full_attention" if rope else "sliding_attention" for rope in rotates]
    if layer_types is None:
        first = cfg.get("max_window_layers", QWEN_DEFAULT_MAX_WINDOW_LAYERS)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ModelLoadError(f"{source}: max_window_layers must be a non-negative integer, got {first!r}")
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return {"sliding_layers": _sliding_layers(layer_types, num_layers, source)}


MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe", "olmoe", "gpt_oss", "deepseek_v2", "deepseek_v3",
             "granitemoe", "granitemoeshared")


def moe_fields(cfg: dict, source: str) -> dict:
    """A mixture-of-experts family's fields (transformers' defaults where config.json leaves one out); none for a
    dense family. Mixtral: every layer, experts as wide as intermediate_size, the chosen weights renormalized.
    Qwen2-MoE / Qwen3-MoE: experts of moe_intermediate_size in every decoder_sparse_step-th layer not listed in
    mlp_only_layers (those keep a dense MLP of intermediate_size), renormalized with norm_topk_prob; Qwen2-MoE adds
    a shared expert."""
    model_type = cfg.get("model_type")
    if model_type not in MOE_TYPES:
        return {}
    if model_type in ("glm4_moe", "deepseek_v3"):
        return _grouped_moe_fields(cfg, source, **GROUPED_MOE_DEFAULTS[model_type])
    if model_type == "deepseek_v2":
        return _deepseek_v2_moe_fields(cfg, source)
    if model_type == "gpt_oss":
        return _gpt_oss_fields(cfg, source)
    num_layers = positive_int(cfg, "num_hidden_layers", source)
    local = model_type in ("mixtral", "granitemoe", "granitemoeshared")  # their count's name; transformers' defaults
    key = "num_local_experts" if "num_local_experts" in cfg or local else "num_experts"
    experts = positive_int(cfg, key, source, 8 if local else {"olmoe": 64}.get(model_type, 60))
    per_token = positive_int(cfg, "num_experts_per_tok", source, 2 if local else {"olmoe": 8}.get(model_type, 4))
    if per_token > experts:
        raise ModelLoadError(f"{source}: num_experts_per_tok ({per_token}) exceeds the {experts} experts")
    if model_type == "mixtral":
        return {"num_experts": experts, "num_experts_per_tok": per_token, "norm_topk_prob": True,
                "moe_intermediate_size": positive_int(cfg, "intermediate_size", source)}
    if model_type in ("granitemoe", "granitemoeshared"):  # Mixtral's routing; an ungated shared MLP (Shared)
        shared = _count(cfg, "shared_intermediate_size", 0, source) if model_type == "granitemoeshared" else 0
        return {"num_experts": experts, "num_experts_per_tok": per_token, "norm_topk_prob": True,
                "moe_intermediate_size": positive_int(cfg, "intermediate_size", source),
                "shared_expert_intermediate_size": shared, "shared_expert_gated": False}
    if model_type == "olmoe":  # every layer, experts as wide as intermediate_size
        return {"num_experts": experts, "num_experts_per_tok": per_token,
                "norm_topk_prob": _flag(cfg, "norm_topk_prob", False, source),
                "moe_intermediate_size": positive_int(cfg, "intermediate_size", source)}
    step = positive_int(cfg, "decoder_sparse_step", source, 1)
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers
                                              for i in dense):
        raise ModelLoadError(f"{source}: mlp_only_layers must list layer indices below {num_layers}, got {dense!r}")
    layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    norm = _flag(cfg, "norm_topk_prob", False, source)
    shared = positive_int(cfg, "shared_expert_intermediate_size", source, 5632) if model_type == "qwen2_moe" else 0
    return {"num_experts": experts, "num_experts_per_tok": per_token, "norm_topk_prob": norm,
            "moe_intermediate_size": positive_int(cfg, "moe_intermediate_size", source, 1408 if shared else 768),
            "shared_expert_intermediate_size": shared, "moe_layers": None if all(layers) else layers}


def _flag(cfg: dict, key: str, default: bool, source: str) -> bool:
    value = cfg.get(key, default)
    if not isinstance(value, bool):
        raise ModelLoadError(f"{source}: {key} must be true or false, got {value!r}")
    return value


# transformers' Glm4MoeConfig and DeepseekV3Config defaults where config.json leaves a field out
GROUPED_MOE_DEFAULTS = {
    "glm4_moe": dict(experts=128, per_token=8, groups=1, topk_groups=1, width=1408, dense=1, shared=1, scale=1.0),
    "deepseek_v3": dict(experts=256, per_token=8, groups=8, topk_groups=4, width=2048, dense=3, shared=1, scale=2.5),
}


def _grouped_moe_fields(cfg: dict, source: str, **defaults) -> dict:
    """GLM-4.5's and DeepSeek-V3's experts: dense MLPs in the first first_k_dense_replace layers, then
    n_routed_experts experts chosen by sigmoid scores in groups, and n_shared_experts shared experts' worth of
    columns added ungated."""
    return {**_deepseek_moe_fields(cfg, source, **defaults, norm=True), "moe_routing": "sigmoid_groups"}


def _deepseek_v2_moe_fields(cfg: dict, source: str) -> dict:
    """DeepSeek-V2's experts (transformers' DeepseekV2Config defaults): chosen by their softmax scores, among the
    topk_group best of n_group groups by each group's best score where topk_method is group_limited_greedy, the
    weights times routed_scaling_factor (renormalized first with norm_topk_prob, as DeepSeek's own code does)."""
    method = cfg.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise ModelLoadError(f"{source}: topk_method must be greedy or group_limited_greedy, got {method!r}")
    grouped = method == "group_limited_greedy"
    fields = _deepseek_moe_fields(cfg if grouped else {**cfg, "n_group": 1, "topk_group": 1}, source, experts=64,
                                  per_token=6, groups=1, topk_groups=1, width=1407, dense=0, shared=2, scale=1.0,
                                  norm=False)
    return {**fields, "moe_routing": "softmax_groups"}


def _deepseek_moe_fields(cfg: dict, source: str, *, experts: int, per_token: int, groups: int, topk_groups: int,
                         width: int, dense: int, shared: int, scale: float, norm: bool) -> dict:
    """The experts' fields GLM-4.5 and both DeepSeeks name alike (the keyword arguments: the family's defaults)."""
    num_layers = positive_int(cfg, "num_hidden_layers", source)
    key = "num_local_experts" if "num_local_experts" in cfg else "n_routed_experts"
    experts = positive_int(cfg, key, source, experts)
    per_token = positive_int(cfg, "num_experts_per_tok", source, per_token)
    groups = positive_int(cfg, "n_group", source, groups)
    topk_groups = positive_int(cfg, "topk_group", source, topk_groups)
    if per_token > experts or experts % groups or topk_groups > groups:
        raise ModelLoadError(f"{source}: {experts} experts in n_group={groups} groups, topk_group={topk_groups} of "
                             f"them and num_experts_per_tok={per_token} do not fit together")
    width = positive_int(cfg, "moe_intermediate_size", source, width)
    dense = _count(cfg, "first_k_dense_replace", dense, source)
    shared = _count(cfg, "n_shared_experts", shared, source)
    every = positive_int(cfg, "moe_layer_freq", source, 1)  # DeepSeek: experts in layers i % moe_layer_freq == 0
    layers = tuple(i >= dense and i % every == 0 for i in range(num_layers))
    return {"num_experts": experts, "num_experts_per_tok": per_token,
            "norm_topk_prob": _flag(cfg, "norm_topk_prob", norm, source),
            "moe_intermediate_size": width, "shared_expert_intermediate_size": width * shared,
            "shared_expert_gated": False, "moe_layers": None if all(layers) else layers,
            "num_expert_groups": groups, "topk_expert_groups": topk_groups,
            "routed_scaling_factor": positive_float(cfg.get("routed_scaling_factor", scale), "routed_scaling_factor",
                                                    source)}


def _count(cfg: dict, key: str, default: int, source: str) -> int:
    value = cfg.get(key, default)
    value = 0 if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ModelLoadError(f"{source}: {key} must be a non-negative integer, got {value!r}")
    return value


MLA_TYPES = ("deepseek_v2", "deepseek_v3")


def latent_attention_config(cfg: dict, source: str) -> dict:
    """A DeepSeek config.json with the fields every family reads set as its latent attention runs (see
    ModelConfig.kv_lora_rank): one KV head as wide as the latent and the rotary key together. Its own head_dim (the
    rotary key's width) and num_key_value_heads (the heads' count) describe transformers' expanded attention."""
    width = positive_int(cfg, "kv_lora_rank", source, 512) + positive_int(cfg, "qk_rope_head_dim", source, 64)
    cfg = {**cfg, "num_key_value_heads": 1, "head_dim": width}
    cfg.pop("partial_rotary_factor", None)
    return cfg


def latent_attention_fields(cfg: dict, source: str) -> dict:
    """DeepSeek's latent attention as ModelConfig fields (transformers' DeepseekV2Config / DeepseekV3Config
    defaults); none for another family. The scores are scaled by (qk_nope_head_dim + qk_rope_head_dim) ** -0.5,
    times mscale(factor, mscale_all_dim) squared under a scaled rotary embedding (transformers'
    yarn_apply_mscale); the rotary dimensions pair as (2i, 2i + 1) unless rope_interleave is false (V3)."""
    if cfg.get("model_type") not in MLA_TYPES:
        return {}
    rope = positive_int(cfg, "qk_rope_head_dim", source, 64)
    nope = positive_int(cfg, "qk_nope_head_dim", source, 128)
    if rope % 2:
        raise ModelLoadError(f"{source}: qk_rope_head_dim must be even (it rotates in pairs), got {rope}")
    q_rank = cfg.get("q_lora_rank", 1536)
    scale = (nope + rope) ** -0.5
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind != "default" and params.get("mscale_all_dim"):
        factor = positive_float(params.get("factor"), "rope factor", source)
        mscale = 1.0 if factor <= 1 else 0.1 * params["mscale_all_dim"] * math.log(factor) + 1.0
        scale *= mscale * mscale
    interleaved = cfg.get("model_type") == "deepseek_v2" or _flag(cfg, "rope_interleave", True, source)
    return {"kv_lora_rank": positive_int(cfg, "kv_lora_rank", source, 512),
            "q_lora_rank": 0 if q_rank is None else positive_int(cfg, "q_lora_rank", source),
            "qk_nope_head_dim": nope, "qk_rope_head_dim": rope,
            "v_head_dim": positive_int(cfg, "v_head_dim", source, 128),
            "attention_multiplier": scale, "rotary_interleaved": interleaved}


# gpt-oss's defaults where config.json leaves them out (transformers' GptOssConfig): its YaRN scaling and rotary base.
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
GPT_OSS_ROPE_THETA = 150_000.0


def _gpt_oss_fields(cfg: dict, source: str) -> dict:
    """gpt-oss (transformers' GptOssConfig defaults): every layer a mixture of num_local_experts experts as wide as
    intermediate_size, each token's num_experts_per_tok chosen by the router's largest logits and weighted by their
    softmax; the router and every expert projection carry biases; the experts' SwiGLU clamps gate and up to
    swiglu_limit; attention sinks in every layer, which alternate windowed and full (layer_types)."""
    num_layers = positive_int(cfg, "num_hidden_layers", source)
    experts = positive_int(cfg, "num_local_experts", source, 128)
    per_token = positive_int(cfg, "num_experts_per_tok", source, 4)
    if per_token > experts:
        raise ModelLoadError(f"{source}: num_experts_per_tok ({per_token}) exceeds the {experts} experts")
    fields = {"num_experts": experts, "num_experts_per_tok": per_token, "moe_routing": "topk_softmax",
              "moe_intermediate_size": positive_int(cfg, "intermediate_size", source), "moe_bias": True,
              "attention_sinks": True,
              "swiglu_limit": positive_float(cfg.get("swiglu_limit", 7.0), "swiglu_limit", source),
              "swiglu_alpha": positive_float(cfg.get("swiglu_alpha", 1.702), "swiglu_alpha", source)}
    if sliding_window(cfg, source) is not None:
        layer_types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                                 for i in range(num_layers)]
        fields["sliding_layers"] = _sliding_layers(layer_types, num_layers, source)
    return fields
