"""GGUF checkpoints onto jserve's model: which file a path names, the ModelConfig its metadata describes, and its
tensors under Hugging Face names, so the safetensors loader's placement (checkpoints.safetensors_loader.
assemble_state: fused q|k|v and gate|up, tensor-parallel blocks, replicated KV heads) builds every parameter.

The file is read by checkpoints.gguf_reader (a tensor is decoded block by block when its parameter is placed).
What is llama.cpp's own convention, and undone here:

- names: `token_embd`, `blk.N.attn_q` ... (llama.cpp's gguf-py tensor_mapping) for `model.embed_tokens`,
  `model.layers.N.self_attn.q_proj` ...;
- the q and k rows of a Llama (and a Mistral, which llama.cpp stores as a Llama) are permuted for llama.cpp's
  rotary, which rotates adjacent pairs where Hugging Face's rotates halves (convert_hf_to_gguf.py's
  LlamaModel.permute; transformers' LlamaTensorProcessor undoes it the same way); Qwen2 and Qwen3 are stored in
  Hugging Face's order;
- the config is metadata keys (`llama.embedding_length` ...), with no `config.json`: tied embeddings are the
  absence of `output.weight`, biases the presence of their tensors, and Llama 3's rope scaling a `rope_freqs`
  tensor of per-frequency divisors;
- a Granite file is a Llama one (its q/k rows permuted alike) with its multipliers as `granite.embedding_scale`,
  `attention.scale`, `residual_scale` and `logit_scale`; a `granitemoe` one adds stacked experts as wide as
  `feed_forward_length` (renormalized) and, where `expert_shared_feed_forward_length` is set, an ungated shared MLP
  (`ffn_{gate,up,down}_shexp`: GraniteMoeShared);
- a Phi-3 file keeps Hugging Face's fused `attn_qkv` and `ffn_up` (gate and up), its partial rotary embedding as
  `rope.dimension_count`, and longrope as the `rope_factors_short` / `rope_factors_long` tensors with
  `rope.scaling.attn_factor` and `rope.scaling.original_context_length`;
- a Gemma, Gemma 2 or Gemma 3 file (convert_hf_to_gguf.py's GemmaModel, Gemma2Model, Gemma3Model) is stored in
  Hugging Face's q/k order, with every norm weight stored as the (1 + weight) the model multiplies by (so the
  safetensors loader's norm_weight_offset is not added again). Gemma 2 and 3 name their sandwich norms
  `post_attention_norm`, `ffn_norm` (the pre-feedforward one) and `post_ffw_norm`. What config.json says and the
  file does not is llama.cpp's own reading (llama-model.cpp load_hparams): the rotary base 10000 where there is no
  `rope.freq_base` (Gemma and Gemma 2 files have none); Gemma 2's window 4096 and soft caps 50 / 30 where the file
  has no `attention.sliding_window`, `attn_logit_softcapping`, `final_logit_softcapping`; the windowed layers every
  one of each 2 (Gemma 2) or 5 of each 6 (Gemma 3) but the last (set_swa_pattern; an
  `attention.sliding_window_pattern` where a file has one); Gemma 3's windowed layers rotating by
  `rope.freq_base_swa` (10000 without it), unscaled; and no query_pre_attn_scalar: llama.cpp scales queries by
  1/sqrt(head_dim), or 1/sqrt(hidden / heads) in its 27B models (46 layers for Gemma 2, 62 for Gemma 3);
- a mixture of experts (convert_hf_to_gguf.py's LlamaModel for Mixtral, Qwen2MoeModel, Qwen3MoeModel) is a `llama`
  file with `expert_count` > 0 (Mixtral: experts as wide as `feed_forward_length`, q/k permuted), a `qwen2moe` or a
  `qwen3moe` one; `expert_count` and `expert_used_count` are its experts and top-k, `expert_feed_forward_length`
  and `expert_shared_feed_forward_length` the Qwen widths (n_ff / n_expert_used and n_ff without them); each
  layer's experts are one stacked `blk.N.ffn_{gate,up,down}_exps` [experts, out, in] with the router
  `ffn_gate_inp`, Qwen2-MoE's shared expert `ffn_{gate,up,down}_shexp` and its gate `ffn_gate_inp_shexp`
  (a [hidden] vector, read as [1, hidden]). Whether the chosen weights are renormalized is the architecture's, as
  llama.cpp builds it (llm_build_* norm_w; no `expert_weights_norm` is read): yes for Mixtral and Qwen3-MoE, no for
  Qwen2-MoE; and every layer is a mixture of experts (llama.cpp has no dense layers in these architectures, so no
  mlp_only_layers or decoder_sparse_step). An `olmoe` file is one too, its experts `feed_forward_length` wide and
  their weights not renormalized;
- an OLMo 2 file (convert_hf_to_gguf.py's Olmo2Model) is stored in Hugging Face's q/k order, its q/k norms as wide
  as the projections (`attn_q_norm`, `attn_k_norm`) and its block-output norms `post_attention_norm` and
  `post_ffw_norm`, with no input norms. An OLMo 3 file is an `olmo2` one with `attention.sliding_window` and the
  layers it applies to (`attention.sliding_window_pattern`), its YaRN attention factor `rope.scaling.attn_factor`;
- a GLM-4 file (convert_hf_to_gguf.py's Glm4Model) keeps Hugging Face's interleaved q/k rows and fused `ffn_up`
  (gate and up), its partial rotary embedding as `rope.dimension_count`, and its sandwich norms as Gemma 2's;
- a gpt-oss file (GptOssModel) keeps Hugging Face's q/k order, its attention sinks as `attn_sinks`, the router as
  `ffn_gate_inp` with a bias, and the experts de-interleaved into `ffn_{gate,up,down}_exps` stacks with their
  biases (MXFP4 where OpenAI's checkpoint was, which gguf-py decodes). llama.cpp windows every other layer (the
  first of each two, set_swa_pattern(2)) and builds the clamped SwiGLU with transformers' constants, as jserve
  reads a config.json without them. YaRN is served with transformers' `truncate: false`, as gpt-oss's own config
  sets it (the file has no key for it; llama.cpp rounds the correction range outward for every model).
- a `deepseek2` file (DeepseekV2Model; jserve.gguf_deepseek) keeps Hugging Face's interleaved rotary rows (llama.cpp
  rotates deepseek2's adjacent pairs), with `attention.kv_lora_rank`, `q_lora_rank` (low-rank queries:
  `attn_q_a`, `attn_q_a_norm`, `attn_q_b`), `rope.dimension_count` (qk_rope_head_dim), `leading_dense_block_count`
  and the expert keys. Its current form stores the latent attention as one KV head (`key_length` kv_lora_rank +
  rope, `value_length` kv_lora_rank), the heads' widths as `key_length_mla` / `value_length_mla`, and kv_b_proj split
  per head into `attn_k_b` (the key rows transposed, [heads, kv_lora_rank, qk_nope]) and `attn_v_b`, which are read
  back together as kv_b_proj; the older form keeps `attn_kv_b` whole, its widths as `key_length` / `value_length`.
  The experts' gating function is the model: sigmoid (`expert_gating_func` 2) is DeepSeek-V3's, with the router's
  selection bias `exp_probs_b` and groups (`expert_group_count`, `expert_group_used_count`), softmax (1, or none, as
  llama.cpp reads older files) DeepSeek-V2's, choosing among all its experts: llama.cpp ranks a softmax model's
  groups by their two best scores' sum, not by the best one as DeepSeek-V2's group_limited_greedy does, so a
  softmax file with restricting groups is refused. `expert_weights_scale` (none: 1) and `expert_weights_norm` are
  routed_scaling_factor and norm_topk_prob. YaRN is served as llama.cpp serves it: `rope.scaling.yarn_log_multiplier`
  is 0.1 * DeepSeek's mscale_all_dim, the scores are scaled by mscale(factor, mscale_all_dim) squared, and the rotary
  embedding is unscaled (llama.cpp takes mscale as mscale_all_dim, which DeepSeek's configs set alike; the file
  stores no mscale). Multi-token-prediction layers are not in the file.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from checkpoints import is_gguf_file
from checkpoints.gguf_reader import GGUFFile, GGUFTensor, open_gguf
from checkpoints.safetensors_loader import ParamSource, Tensor, assemble_state, hf_names
from jserve.config import ModelConfig, ModelLoadError
from jserve.config_json import RopeScaling
from jserve.gguf_deepseek import LAYER_NAMES as _DEEPSEEK2_LAYER_NAMES
from jserve.gguf_deepseek import SELECTION_BIAS, deepseek2_fields, latent_tensors

# GGUF general.architecture -> jserve model_type. A Mistral GGUF says "llama" (llama.cpp converts Mistral as one).
SUPPORTED_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                           "granite": "granite", "gemma": "gemma", "gemma2": "gemma2", "gemma3": "gemma3_text",
                           "smollm3": "smollm3", "olmo2": "olmo2", "glm4": "glm4", "qwen2moe": "qwen2_moe",
                           "qwen3moe": "qwen3_moe", "olmoe": "olmoe", "gpt-oss": "gpt_oss",
                           "deepseek2": "deepseek_v2",  # deepseek_v3 where its experts are sigmoid-gated
                           "granitemoe": "granitemoe"}  # granitemoeshared where it has a shared MLP
GGUF_ARCHITECTURE_OF = {model_type: arch for arch, model_type in SUPPORTED_ARCHITECTURES.items()}
GGUF_ARCHITECTURE_OF["mixtral"] = "llama"  # a llama file with experts (general.architecture says nothing more)
GGUF_ARCHITECTURE_OF["deepseek_v3"] = "deepseek2"
GGUF_ARCHITECTURE_OF["granitemoeshared"] = "granitemoe"
# Architectures a mixture of experts may be stored as (a llama one is Mixtral where expert_count > 0); the others
# must have none. Qwen3-MoE and Mixtral renormalize the chosen experts' weights, Qwen2-MoE does not (llama.cpp's
# build_moe_ffn norm_w in llm_build_llama / llm_build_qwen3moe / llm_build_qwen2moe / llm_build_olmoe).
_MOE_ARCHITECTURES = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False, "gpt-oss": False,
                      "granitemoe": True}
# Architectures whose q/k rows llama.cpp's converter permutes (LlamaModel.undo_permute; GraniteModel and
# SmolLM3Model inherit it). A SmolLM3 file stores no NoPE layers: llama.cpp takes every fourth (n_no_rope_layer_step),
# as transformers' default no_rope_layer_interval does.
_PERMUTED_QK = frozenset({"llama", "granite", "granitemoe", "smollm3"})
# Gemma's llama.cpp defaults (llama-model.cpp load_hparams): every n-th layer attends to all positions, the others
# through the window (hparams.set_swa_pattern(n)); the 27B models' layer counts, whose queries are scaled by
# 1/sqrt(hidden / heads) instead of 1/sqrt(head_dim); Gemma 2's window and soft caps where the file has none.
_GEMMA_SWA_PERIOD = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA2_DEFAULTS = {"attention.sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
_GEMMA3_LOCAL_ROPE_THETA = 10000.0  # llama.cpp's rope_freq_base_train_swa for Gemma 3 without rope.freq_base_swa
# Granite's multipliers: convert_hf_to_gguf.py writes each (renamed *_scale) only where it is not zero.
_GRANITE_SCALES = {"embedding_scale": "embedding_multiplier", "attention.scale": "attention_multiplier",
                   "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling"}

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Phi-3's fused tensors (convert_hf_to_gguf.py keeps Hugging Face's qkv_proj and gate_up_proj whole).
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Gemma 2 and 3's sandwich norms (gguf-py's tensor_mapping: ATTN_POST_NORM, FFN_PRE_NORM is ffn_norm, FFN_POST_NORM).
_GEMMA2_LAYER_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                       "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# A mixture of experts' tensors (gguf-py's tensor_mapping: FFN_GATE_INP, FFN_*_EXP, FFN_*_SHEXP, FFN_GATE_INP_SHEXP):
# the experts as whole [experts, out, in] stacks under the safetensors loader's stack names.
_MOE_LAYER_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
                    "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj"}
_SHARED_EXPERT_NAMES = {"ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                        "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj"}
_DENSE_MLP = ("ffn_gate", "ffn_up", "ffn_down")
_QWEN_MOE_LAYER_NAMES = {k: v for k, v in _LAYER_NAMES.items() if k not in _DENSE_MLP} | _MOE_LAYER_NAMES
# GLM-4's fused gate|up (gguf-py maps it to ffn_up) and sandwich norms, under GLM-4's own names (tensor_views renames
# those as every GLM-4 checkpoint's).
_GLM4_LAYER_NAMES = {**_LAYER_NAMES, "ffn_up": "mlp.gate_up_proj", "post_attention_norm": "post_self_attn_layernorm",
                     "ffn_norm": "post_attention_layernorm", "post_ffw_norm": "post_mlp_layernorm"}
# OLMo 2's norms of each block's outputs (and no input norms): gguf-py's ATTN_POST_NORM and FFN_POST_NORM.
_OLMO2_LAYER_NAMES = {k: v for k, v in _LAYER_NAMES.items() if k not in ("attn_norm", "ffn_norm")} | {
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# gpt-oss: the norm of the MLP's input is post_attention_norm; its sinks, router and experts carry their own names.
_GPT_OSS_LAYER_NAMES = {k: v for k, v in _QWEN_MOE_LAYER_NAMES.items() if k != "ffn_norm"} | {
    "post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks"}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_HF_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
# llama.cpp's per-frequency rotary divisors: read into the config, not a parameter.
ROPE_FREQS = "rope_freqs.weight"
LONGROPE_FACTORS = {"short_factor": "rope_factors_short.weight", "long_factor": "rope_factors_long.weight"}
_REQUIRED = object()


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file a model path names: the path itself where it is a GGUF file (named .gguf, or an Ollama blob),
    the one .gguf file of a directory that has no safetensors checkpoint, else None (a Hugging Face checkpoint
    directory). A directory with several .gguf files (quantizations of one model, or the parts of a split file)
    raises ModelLoadError: name one."""
    path = Path(path)
    if path.is_file():
        return path if is_gguf_file(path) else None
    if not path.is_dir() or any((path / name).is_file()
                                for name in ("model.safetensors", "model.safetensors.index.json")):
        return None
    files = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if len(files) > 1:
        names = ", ".join(p.name for p in files[:6]) + (", ..." if len(files) > 6 else "")
        raise ModelLoadError(f"{path}: holds {len(files)} GGUF files ({names}); name the one to load "
                             f"(--model {path / files[0].name})")
    return files[0] if files else None


def _layer_names(arch: str) -> dict[str, str]:
    return {"phi3": _PHI3_LAYER_NAMES, "gemma2": _GEMMA2_LAYER_NAMES, "gemma3": _GEMMA2_LAYER_NAMES,
            "llama": _LAYER_NAMES | _MOE_LAYER_NAMES, "qwen3moe": _QWEN_MOE_LAYER_NAMES,
            "olmoe": _QWEN_MOE_LAYER_NAMES, "qwen2moe": _QWEN_MOE_LAYER_NAMES | _SHARED_EXPERT_NAMES,
            "olmo2": _OLMO2_LAYER_NAMES, "glm4": _GLM4_LAYER_NAMES,
            "granitemoe": _QWEN_MOE_LAYER_NAMES | {k: v for k, v in _SHARED_EXPERT_NAMES.items()
                                                   if k != "ffn_gate_inp_shexp"},
            "gpt-oss": _GPT_OSS_LAYER_NAMES, "deepseek2": _DEEPSEEK2_LAYER_NAMES}.get(arch, _LAYER_NAMES)


def hf_tensor_name(name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor of the Llama / Qwen2 / Qwen3 / Phi-3 / Granite / Gemma / SmolLM3 /
    Mixtral / Qwen-MoE families (a stack of experts under its whole-stack name, mlp.experts.gate_proj ...); None for
    any other name."""
    layer_names = _layer_names(arch)
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    if (m := _GGUF_LAYER_RE.match(name)) and m[2] in layer_names:
        return f"model.layers.{m[1]}.{layer_names[m[2]]}.{m[3]}"
    if m and arch == "deepseek2" and (m[2], m[3]) == (SELECTION_BIAS, "bias"):
        return f"model.layers.{m[1]}.mlp.gate.e_score_correction_bias"
    return None


def gguf_tensor_name(hf_name: str, arch: str = "llama") -> str:
    """The GGUF name of a Hugging Face tensor name (the inverse of hf_tensor_name), for error messages: a part of a
    fused weight (q_proj, gate_proj ...) is named by its fused tensor in a Phi-3 file, a stack of experts
    (hf_names' `mlp.experts.N.gate_proj.weight (N: each expert)`) by its stacked tensor."""
    hf_name = re.sub(r"\.experts\.N\.(\w+\.\w+) \(N: each expert\)$", r".experts.\1", hf_name)
    for gguf_name, hf in _GLOBAL_NAMES.items():
        if hf == hf_name:
            return gguf_name
    if m := _HF_LAYER_RE.match(hf_name):
        part = m[2]
        if arch == "phi3":
            part = {"self_attn.q_proj": "self_attn.qkv_proj", "self_attn.k_proj": "self_attn.qkv_proj",
                    "self_attn.v_proj": "self_attn.qkv_proj"}.get(part, part)
        if arch in ("phi3", "glm4"):
            part = {"mlp.gate_proj": "mlp.gate_up_proj", "mlp.up_proj": "mlp.gate_up_proj"}.get(part, part)
        for gguf_name, hf in _layer_names(arch).items():
            if hf == part:
                return f"blk.{m[1]}.{gguf_name}.{m[3]}"
    return hf_name


def rotary_row_order(num_heads: int, head_dim: int) -> np.ndarray:
    """Where each Hugging Face row of a Llama q (or k) projection is in a GGUF file: llama.cpp's converter stores
    row (head h, half i, j) at (h, j, i) (permute: [heads, 2, head_dim/2] -> [heads, head_dim/2, 2]), so that its
    rotary, which rotates adjacent pairs, sees the pairs Hugging Face's rotate_half forms from the two halves."""
    stored = np.arange(num_heads * head_dim).reshape(num_heads, 2, head_dim // 2).swapaxes(1, 2).reshape(-1)
    order = np.empty_like(stored)
    order[stored] = np.arange(stored.size)  # GGUF row k holds HF row stored[k]
    return order


def gguf_model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig a GGUF file's metadata describes (what transformers derives from it, through the same
    ModelConfig.from_hf_dict a config.json goes through). An architecture, a tensor type or a rope scaling jserve
    cannot serve raises ModelLoadError naming it."""
    file = _open_checked(path)
    arch = file.architecture
    tensors = file.tensors

    def key(name: str, default=_REQUIRED):
        value = file.get(f"{arch}.{name}", default)
        if value is _REQUIRED:
            raise ModelLoadError(f"{file.path}: GGUF metadata has no {arch}.{name}")
        return value

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # one count per layer in some files: jserve's layers all have one shape
        if len(set(kv_heads)) != 1:
            raise ModelLoadError(f"{file.path}: layers with different KV head counts ({sorted(set(kv_heads))}) are "
                                 "not supported")
        kv_heads = kv_heads[0]
    # Phi-3's and GLM-4's rope.dimension_count is their rotated dimensions only (partial rotary embedding)
    partial = arch in ("phi3", "glm4")
    head_dim = int(key("attention.key_length", 0) or (not partial and key("rope.dimension_count", 0))
                   or hidden // heads)
    rotary, value = int(key("rope.dimension_count", head_dim)), int(key("attention.value_length", head_dim))
    if arch != "deepseek2" and (value != head_dim or (rotary != head_dim and not partial)):
        raise ModelLoadError(f"{file.path}: rotary dimensions {rotary} and value length {value} must equal the head "
                             f"dimension {head_dim} (partial rotary is supported in phi3 and glm4 files only)")
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{file.path}: no token_embd.weight tensor")
    window = key("attention.sliding_window", None)
    eos = [file.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    cfg = {
        "model_type": SUPPORTED_ARCHITECTURES[arch],
        "vocab_size": tensors["token_embd.weight"].shape[0],
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "rope_scaling": None if arch == "deepseek2" else _rope_scaling(file, arch, rotary),
        "partial_rotary_factor": rotary / head_dim,
        "max_position_embeddings": int(key("context_length")),
        "tie_word_embeddings": "output.weight" not in tensors,
        "sliding_window": int(window) if window else None,
        "use_sliding_window": bool(window),
        "max_window_layers": 0,  # a GGUF file's window applies to every layer (llama.cpp's reading)
        "bos_token_id": file.get("tokenizer.ggml.bos_token_id"),
        # llama.cpp ends generation at end-of-turn and end-of-message tokens too (a chat model's stop tokens)
        "eos_token_id": list(dict.fromkeys(i for i in eos if i is not None)),
    }
    if arch in ("granite", "granitemoe"):
        cfg.update({name: float(key(gguf_key)) for gguf_key, name in _GRANITE_SCALES.items()
                    if key(gguf_key, None)})
    if arch in ("gemma2", "gemma3"):
        cfg.update(_gemma_config(file, arch, cfg))
    if arch == "olmo2" and window:
        cfg.update(_olmo3_config(file, cfg))
    if arch == "deepseek2":
        cfg.update(deepseek2_fields(file, cfg, _rope_scaling))
    elif int(key("expert_count", 0) or 0) > 0:
        cfg.update(_moe_config(file, arch, cfg))
    config = ModelConfig.from_hf_dict(cfg, source=str(file.path))
    # Biases are whatever tensors the file has (Qwen2's q/k/v; a Llama's with attention_bias or mlp_bias).
    config = dataclasses.replace(config, qkv_bias="blk.0.attn_q.bias" in tensors,
                                 o_bias="blk.0.attn_output.bias" in tensors, mlp_bias="blk.0.ffn_up.bias" in tensors)
    if ROPE_FREQS in tensors:
        config = dataclasses.replace(config, rope_scaling=_freq_factors(file, config))
    return config


def load_gguf_state(path: str | Path, config: ModelConfig, shapes: dict[tuple, tuple[tuple[int, ...], np.dtype]],
                    place: Callable[[tuple, ParamSource], object]) -> dict[tuple, object]:
    """checkpoints.safetensors_loader.load_state for a GGUF file: every parameter of `shapes` built by `place`
    from the file's tensors, one parameter at a time, each decoded as its blocks are read."""
    file = _open_checked(path)
    permuted = file.architecture in _PERMUTED_QK
    # deepseek2: each layer's attn_k_b and attn_v_b read together as the attn_kv_b they were split from
    by_name = latent_tensors(file, config) if file.architecture == "deepseek2" else file.tensors

    def tensors() -> Iterator[tuple[str, Tensor, str]]:
        for name, tensor in by_name.items():
            if name == ROPE_FREQS or name in LONGROPE_FACTORS.values():
                continue
            hf_name = hf_tensor_name(name, file.architecture)
            if hf_name is None:
                m = _GGUF_LAYER_RE.match(name)
                dense = m is not None and m[2] in _DENSE_MLP and file.architecture in ("qwen2moe", "qwen3moe", "olmoe",
                                                                                        "granitemoe")
                raise ModelLoadError(f"{file.path}: unexpected tensor {name} ({tensor.type_name}) for a GGUF "
                                     f"{file.architecture} model" + (" (llama.cpp's has experts in every layer, no "
                                                                     "dense MLP)" if dense else ""))
            if permuted:
                tensor = _unpermuted(tensor, name, config)
            tensor = _moe_tensor(tensor, name)
            yield hf_name, tensor, f"{file.path} ({name})"

    # llama.cpp's converter stores a Gemma norm as the (1 + weight) it multiplies by: nothing to add at load
    state_config = dataclasses.replace(config, norm_weight_offset=0.0)
    return assemble_state(tensors(), state_config, shapes, place, str(file.path), describe=lambda p: "/".join(
        dict.fromkeys(gguf_tensor_name(n, file.architecture) for n in hf_names(p).split("/"))))


def _open_checked(path: str | Path) -> GGUFFile:
    file = open_gguf(path)
    arch = file.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{file.path}: GGUF architecture {arch!r} is not supported; jserve serves "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)} (a Mistral GGUF is a llama one)")
    experts = int(file.get(f"{arch}.expert_count", 0) or 0)
    if experts > 0 and arch not in _MOE_ARCHITECTURES and arch != "deepseek2":
        raise ModelLoadError(f"{file.path}: a mixture-of-experts {arch} model ({arch}.expert_count {experts}) is not "
                             "supported (llama, qwen2moe, qwen3moe, olmoe, gpt-oss and deepseek2 ones are)")
    # llama.cpp: "n_expert must be > 0 for QWEN2MOE" (and its MoE architectures alike)
    if experts == 0 and arch in ("qwen2moe", "qwen3moe", "olmoe", "deepseek2"):
        raise ModelLoadError(f"{file.path}: a GGUF {arch} model needs {arch}.expert_count > 0")
    if int(file.get("split.count", 1)) > 1:
        raise ModelLoadError(f"{file.path}: part of a GGUF split into {file.get('split.count')} files; merge them "
                             "first (llama-gguf-split --merge)")
    file.check_tensor_types()
    return file


def _gemma_config(file: GGUFFile, arch: str, cfg: dict) -> dict:
    """Gemma 2 / Gemma 3's config.json fields as llama.cpp reads them from a file (the module docstring says which
    defaults it takes)."""
    layers = cfg["num_hidden_layers"]
    defaults = _GEMMA2_DEFAULTS if arch == "gemma2" else {}

    def value(name: str):
        found = file.get(f"{arch}.{name}")
        return defaults.get(name) if found is None else found

    window = value("attention.sliding_window")
    pattern = file.get(f"{arch}.attention.sliding_window_pattern", _GEMMA_SWA_PERIOD[arch])
    if isinstance(pattern, list):  # one flag per layer: true where the layer is windowed
        if len(pattern) != layers:
            raise ModelLoadError(f"{file.path}: {arch}.attention.sliding_window_pattern has {len(pattern)} flags for "
                                 f"{layers} layers")
        sliding = [bool(flag) for flag in pattern]
    else:  # llama.cpp's set_swa_pattern(n): 0 windows every layer, 1 none, n every layer but each n-th
        period = int(pattern)
        sliding = [period == 0 or i % period < period - 1 for i in range(layers)]
    scalar = cfg["hidden_size"] // cfg["num_attention_heads"] if layers == _GEMMA_27B_LAYERS[arch] else cfg["head_dim"]
    caps = {}
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        cap = None if arch == "gemma3" and name == "attn_logit_softcapping" else value(name)  # Gemma 3 caps no scores
        caps[name] = float(cap) if cap else None
    out = {"sliding_window": int(window) if window else None,
           "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
           "query_pre_attn_scalar": scalar, **caps}
    if arch == "gemma3":
        out["rope_local_base_freq"] = float(file.get(f"{arch}.rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_THETA))
    return out


def _olmo3_config(file: GGUFFile, cfg: dict) -> dict:
    """An OLMo 3 file: an olmo2 one with a window (convert_hf_to_gguf.py's Olmo2Model), on the layers its
    `attention.sliding_window_pattern` flags, else OLMo 3's default ones (config_json.olmo_fields)."""
    layers = cfg["num_hidden_layers"]
    pattern = file.get("olmo2.attention.sliding_window_pattern")
    if pattern is None:
        return {"model_type": "olmo3"}
    if not isinstance(pattern, list) or len(pattern) != layers:
        raise ModelLoadError(f"{file.path}: olmo2.attention.sliding_window_pattern must flag each of the {layers} "
                             f"layers, got {pattern!r}")
    return {"model_type": "olmo3", "layer_types": ["sliding_attention" if flag else "full_attention"
                                                   for flag in pattern]}


def _moe_config(file: GGUFFile, arch: str, cfg: dict) -> dict:
    """A mixture of experts' config.json fields as llama.cpp reads them from a file (the module docstring says which
    defaults it takes): Mixtral's from a llama file, Qwen2-MoE's and Qwen3-MoE's with every layer sparse."""

    def key(name: str, default=_REQUIRED):
        value = file.get(f"{arch}.{name}", default)
        if value is _REQUIRED:
            raise ModelLoadError(f"{file.path}: GGUF metadata has no {arch}.{name} (a mixture of experts needs it)")
        return value

    gating = key("expert_gating_func", None)
    # LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX; gpt-oss's softmax over the chosen logits (SOFTMAX_WEIGHT) is its own
    if gating not in (None, 1) and not (arch == "gpt-oss" and gating == 3):
        raise ModelLoadError(f"{file.path}: {arch}.expert_gating_func {gating} is not supported (1: softmax)")
    scale = key("expert_weights_scale", None)
    if scale not in (None, 0, 1):  # llama.cpp scales the chosen weights only by a scale neither 0 nor 1
        raise ModelLoadError(f"{file.path}: {arch}.expert_weights_scale {scale} is not supported (1)")
    if int(key("expert_shared_count", 0) or 0) > 1:
        raise ModelLoadError(f"{file.path}: {arch}.expert_shared_count {key('expert_shared_count')} is not supported")
    experts, used = int(key("expert_count")), int(key("expert_used_count"))
    if arch == "llama":  # Mixtral: its experts are feed_forward_length wide, their weights renormalized
        return {"model_type": "mixtral", "num_local_experts": experts, "num_experts_per_tok": used}
    if arch == "olmoe":  # feed_forward_length wide too, the weights not renormalized
        return {"num_experts": experts, "num_experts_per_tok": used, "norm_topk_prob": False}
    if arch == "granitemoe":  # experts feed_forward_length wide; an ungated shared MLP (GraniteMoeShared's) if any
        shared = int(key("expert_shared_feed_forward_length", 0) or 0)
        return {"num_local_experts": experts, "num_experts_per_tok": used,
                **({"model_type": "granitemoeshared", "shared_intermediate_size": shared} if shared else {})}
    if arch == "gpt-oss":  # its config.json reads its experts' width from intermediate_size
        return {"num_local_experts": experts, "num_experts_per_tok": used,
                "intermediate_size": int(key("expert_feed_forward_length", 0) or cfg["intermediate_size"])}
    width = cfg["intermediate_size"]
    out = {"num_experts": experts, "num_experts_per_tok": used, "norm_topk_prob": _MOE_ARCHITECTURES[arch],
           "decoder_sparse_step": 1, "mlp_only_layers": [],
           "moe_intermediate_size": int(key("expert_feed_forward_length", 0) or width // max(used, 1))}
    if arch == "qwen2moe":
        out["shared_expert_intermediate_size"] = int(key("expert_shared_feed_forward_length", 0) or width)
    return out


class _ExpertStack:
    """A GGUF [experts, out, in] tensor (a layer's stacked experts) read through one 2-D GGUFTensor per expert, as
    checkpoints.gguf_reader decodes 2-D tensors only."""

    def __init__(self, tensor: GGUFTensor):
        experts, out = tensor.shape[:2]
        self.shape, self.type_name = tuple(tensor.shape), tensor.type_name
        data = tensor.data.reshape(experts, out, -1)
        self.experts = [GGUFTensor(f"{tensor.name}[{e}]", data[e], tensor.qtype, tensor.shape[1:])
                        for e in range(experts)]

    def read(self, index: tuple = (), dtype: np.dtype | type = np.float32) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (3 - len(tuple(index)))
        chosen = np.arange(self.shape[0])[index[0]]
        return np.stack([self.experts[e].read(index[1:], dtype) for e in np.atleast_1d(chosen)]).reshape(
            *np.shape(chosen), *(len(range(*s.indices(n))) for s, n in zip(index[1:], self.shape[1:], strict=True)))


class _Row:
    """A [n] GGUF vector read as the [1, n] matrix Hugging Face stores (Qwen2-MoE's shared expert gate)."""

    def __init__(self, tensor: GGUFTensor):
        self.tensor, self.shape, self.type_name = tensor, (1, *tensor.shape), tensor.type_name

    def read(self, index: tuple = (), dtype: np.dtype | type = np.float32) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (2 - len(tuple(index)))
        return self.tensor.read((), dtype)[None][index]


def _moe_tensor(tensor: GGUFTensor, name: str) -> Tensor:
    """An expert stack or a shared expert gate in the shape the safetensors loader places; other tensors as they
    are (a mis-shaped one: the loader's shape check names it)."""
    if len(tensor.shape) == 3 and name.endswith("_exps.weight"):
        return _ExpertStack(tensor)
    if len(tensor.shape) == 1 and name.endswith("ffn_gate_inp_shexp.weight"):
        return _Row(tensor)
    return tensor


def _unpermuted(tensor: GGUFTensor, name: str, config: ModelConfig) -> GGUFTensor:
    """The tensor with llama.cpp's q/k row permutation undone (rotary_row_order); other tensors as they are."""
    m = _GGUF_LAYER_RE.match(name)
    if m is None or m[2] not in ("attn_q", "attn_k"):
        return tensor
    heads = config.num_heads if m[2] == "attn_q" else config.num_kv_heads // config.kv_head_replicas
    if tensor.shape[0] != heads * config.head_dim:
        return tensor  # a mis-shaped tensor: the loader's shape check names it
    return tensor.with_row_order(rotary_row_order(heads, config.head_dim))


def _rope_scaling(file: GGUFFile, arch: str, rotary: int) -> dict | None:
    present = [name for name in LONGROPE_FACTORS.values() if name in file.tensors]
    if present:  # Phi-3's longrope (convert_hf_to_gguf.py writes no scaling type for it)
        if len(present) != 2:
            raise ModelLoadError(f"{file.path}: has {present[0]} without its pair "
                                 f"({', '.join(LONGROPE_FACTORS.values())})")
        factors = {}
        for key, name in LONGROPE_FACTORS.items():
            values = file.tensors[name].read((), np.float32)
            if values.shape != (rotary // 2,):
                raise ModelLoadError(f"{file.path}: tensor {name} has shape {list(values.shape)}, expected "
                                     f"[{rotary // 2}] (half the rotary dimensions)")
            factors[key] = [float(v) for v in values]
        original = file.get(f"{arch}.rope.scaling.original_context_length")
        if original is None:
            raise ModelLoadError(f"{file.path}: longrope factors without {arch}.rope.scaling.original_context_length")
        return {"rope_type": "longrope", **factors, "original_max_position_embeddings": int(original),
                "attention_factor": float(file.get(f"{arch}.rope.scaling.attn_factor", 1.0))}
    kind = file.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        factor = file.get(f"{arch}.rope.scale_linear")  # older files' linear scaling
        return {"rope_type": "linear", "factor": float(factor)} if factor and factor != 1 else None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(file.get(f"{arch}.rope.scaling.factor", 1.0))}
    if kind == "yarn":
        return _yarn_scaling(file, arch)
    raise ModelLoadError(f"{file.path}: rope scaling {kind!r} ({arch}.rope.scaling.type) is not supported "
                         "(none, linear, yarn, or Llama 3's rope_freqs)")


def _yarn_scaling(file: GGUFFile, arch: str) -> dict:
    """YaRN as convert_hf_to_gguf.py writes it (factor, original context, beta_fast / beta_slow where the model sets
    them), in transformers' rope_parameters. llama.cpp's own extras (an extrapolation factor, an attention factor
    multiplying the computed one, DeepSeek's log multiplier) have no transformers meaning: a file that sets them is
    refused rather than served with other logits than llama.cpp's."""
    prefix = f"{arch}.rope.scaling."
    extras = [key for key in ("yarn_ext_factor", "yarn_attn_factor", "yarn_log_multiplier")
              if file.get(prefix + key) is not None]
    if extras:
        raise ModelLoadError(f"{file.path}: YaRN with {', '.join(prefix + k for k in extras)} is not supported "
                             "(only the factor, the original context length and beta_fast / beta_slow)")
    original = file.get(prefix + "original_context_length")
    if original is None:
        raise ModelLoadError(f"{file.path}: YaRN rope scaling without {prefix}original_context_length")
    scaling = {"rope_type": "yarn", "factor": float(file.get(prefix + "factor", 1.0)),
               "original_max_position_embeddings": int(original)}
    if (factor := file.get(prefix + "attn_factor")) is not None:  # Olmo2Model writes transformers' attention_factor
        scaling["attention_factor"] = float(factor)
    for key in ("beta_fast", "beta_slow"):
        if (value := file.get(f"{prefix}yarn_{key}")) is not None:
            scaling[key] = float(value)
    if arch == "gpt-oss":  # gpt-oss's config: the correction range is not rounded (see the module docstring)
        scaling["truncate"] = False
    return scaling


def _freq_factors(file: GGUFFile, config: ModelConfig) -> RopeScaling:
    factors = file.tensors[ROPE_FREQS].read((), np.float32)
    if factors.shape != (config.head_dim // 2,):
        raise ModelLoadError(f"{file.path}: tensor {ROPE_FREQS} has shape {list(factors.shape)}, expected "
                             f"[{config.head_dim // 2}] (half the head dimension)")
    if config.rope_scaling.kind != "default":
        raise ModelLoadError(f"{file.path}: both {config.rope_scaling.kind} rope scaling and {ROPE_FREQS}")
    return RopeScaling(kind="freq_factors", freq_factors=tuple(float(f) for f in factors))
