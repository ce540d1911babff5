"""Tiny GGUF files written from the tiny Hugging Face checkpoints (hf_models.py) with gguf-py, the way llama.cpp's
convert_hf_to_gguf.py writes them: its metadata keys, its tensor names (gguf-py's own tensor_mapping, not jserve's
map), Llama's q/k rows permuted (LlamaModel.permute), Llama 3's rope scaling as a rope_freqs tensor, norms and
biases in F32, and the byte-level BPE vocabulary as tokenizer.ggml.* (padded to the model's vocabulary with
[PAD<i>] tokens, as get_vocab_base pads it).

Gemma, Gemma 2 and Gemma 3 as GemmaModel, Gemma2Model and Gemma3Model write them: every norm weight plus 1, q/k in
Hugging Face's order, no lm_head, only the metadata keys each writes (no rope.freq_base in a Gemma or Gemma 2 file;
Gemma 2's soft caps and window; Gemma 3's global rotary base and linear scaling, its windowed layers' base as
rope.freq_base_swa, its window). Two things differ, for the tiny checkpoints: the tokenizer is the byte-level BPE one
(the tiny checkpoints have no tokenizer.model for _set_vocab_sentencepiece), and Gemma 3's token_embd keeps every
row (Gemma3Model cuts the rows past the tokenizer's tokens, which a real Gemma 3 has none of).

Mixtral as LlamaModel writes it (arch llama, q/k permuted, expert_count and expert_used_count), Qwen2-MoE and
Qwen3-MoE as Qwen2MoeModel and Qwen3MoeModel (expert_feed_forward_length, and Qwen2-MoE's
expert_shared_feed_forward_length): each layer's experts stacked into one [experts, out, in] tensor per projection
(ffn_gate_exps, ffn_up_exps, ffn_down_exps), the router and the shared expert under gguf-py's names. Like the
converter, a Qwen MoE checkpoint with a dense layer (mlp_only_layers, decoder_sparse_step) cannot be written.

gpt-oss as GptOssModel writes it: its sliding window and expert width, the sinks as attn_sinks.weight, the router as
ffn_gate_inp, each interleaved gate|up stack split into gate (even rows of the [E, out, in] matrix) and up (odd), the
float stacks transposed from [E, in, out], MXFP4 ones repacked (repack_mxfp4: each block's scale byte, then its 32
values re-paired as ggml pairs them, value i with value i + 16) and written as GGML MXFP4.

DeepSeek-V2 and V3 as DeepseekV2Model writes them (arch deepseek2): the rotary rows in Hugging Face's interleaved
order, kv_lora_rank, q_lora_rank (where the queries are low-rank), rope.dimension_count (qk_rope_head_dim),
leading_dense_block_count, the expert keys (count, used count, width, shared count, routed_scaling_factor as
expert_weights_scale, norm_topk_prob as expert_weights_norm where true), the gating function of the checkpoint's
scoring_func (the tiny checkpoints have none: softmax for V2, sigmoid for V3, as the real ones' config.json say),
YaRN's mscale_all_dim as yarn_log_multiplier (times 0.1), the router's e_score_correction_bias as exp_probs_b and the
experts stacked. kv_b="split" writes the converter's current form: one KV head of kv_lora_rank + rope
(key_length) and kv_lora_rank (value_length), the heads' widths as key_length_mla / value_length_mla, n_group and
topk_group as expert_group_count / expert_group_used_count, and kv_b_proj split per head into attn_k_b (the key
rows, transposed: [heads, kv_lora_rank, qk_nope]) and attn_v_b ([heads, v_head, kv_lora_rank]). kv_b="whole" writes
the older form Ollama's DeepSeek-V2 files have: head_count_kv the heads, their widths as key_length / value_length,
no group keys, no gating function for softmax, and the whole attn_kv_b."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
             "granite": "granite", "gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3",
             "smollm3": "smollm3", "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe",
             "olmo2": "olmo2", "olmo3": "olmo2", "olmoe": "olmoe", "glm4": "glm4", "gpt_oss": "gpt-oss",
             "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2", "granitemoe": "granitemoe",
             "granitemoeshared": "granitemoe"}
GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")
T = gguf.GGMLQuantizationType


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, on numpy arrays."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def llama3_rope_factors(rope: dict, theta: float, dim: int) -> np.ndarray:
    """LlamaModel.generate_extra_tensors: the rope_freqs tensor of a llama3-scaled model."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def write_gguf(model_dir: Path, out: Path, matrix_type: str | Callable[[str], str] = "F32",
               name: str = "tiny", extra_tensors: dict[str, np.ndarray] | None = None,
               skip: tuple[str, ...] = (), metadata: dict | None = None, drop: tuple[str, ...] = (),
               kv_b: str = "split") -> Path:
    """Write model_dir's checkpoint and tokenizer as the GGUF file `out`.

    matrix_type: the GGML type of every 2-D tensor ("F32", "F16", "BF16", "Q8_0", "Q4_0", ...), or a function of
    the GGUF tensor name giving it (a type gguf-py cannot quantize to is written as zero blocks). extra_tensors, skip,
    metadata ({key: (value, GGUFValueType)}) and drop (metadata keys left out) bend the file for the error tests and
    for the defaults a reader takes. kv_b: a DeepSeek's form, "split" or "whole" (see the module docstring)."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = GGUF_ARCH[config["model_type"]]
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    w = gguf.GGUFWriter(out, arch)
    w.add_name(name)
    w.add_block_count(layers)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    if arch != "deepseek2":
        w.add_head_count_kv(kv_heads)
    params = config.get("rope_scaling") or config.get("rope_parameters") or {}
    rope = params.get("full_attention", params)  # Gemma 3: its global layers' (TextModel.set_gguf_parameters)
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    if arch not in ("gemma", "gemma2"):  # GemmaModel and Gemma2Model write no rotary keys
        w.add_rope_freq_base(theta)
    if "rope_theta" in params.get("sliding_attention", {}):  # Gemma 3's windowed layers
        w.add_rope_freq_base_swa(params["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(1e-5 if arch == "olmoe" else config["rms_norm_eps"])  # OlmoeModel writes 1e-5
    w.add_vocab_size(config["vocab_size"])
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if arch not in (*GEMMA_ARCHS, "deepseek2"):
        w.add_rope_dimension_count(int(head_dim * partial))  # Phi3MiniModel: the rotated dimensions
    if arch == "gemma2":  # Gemma2Model.set_gguf_parameters
        w.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        w.add_final_logit_softcapping(config["final_logit_softcapping"])
        w.add_sliding_window(config["sliding_window"])
    if arch == "gemma3":  # Gemma3Model.set_gguf_parameters
        if config.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(config["final_logit_softcapping"])
        if config.get("sliding_window_pattern") != 1:
            w.add_sliding_window(config["sliding_window"])
    if arch in ("granite", "granitemoe"):  # GraniteModel.set_gguf_parameters: each multiplier, renamed, where not 0
        w.add_attention_scale(config["attention_multiplier"])
        w.add_embedding_scale(config["embedding_multiplier"])
        w.add_residual_scale(config["residual_multiplier"])
        w.add_logit_scale(config["logits_scaling"])
    if arch == "phi3" and config.get("sliding_window"):
        w.add_sliding_window(config["sliding_window"])
    if config["model_type"] == "olmo3":  # Olmo2Model.set_gguf_parameters
        w.add_sliding_window(config["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in config["layer_types"]])
    if rope.get("rope_type") == "longrope":  # Phi3MiniModel: the factors as tensors, no scaling type
        original = rope.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
        scale = config["max_position_embeddings"] / original
        w.add_rope_scaling_attn_factors(1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(original)))
        w.add_rope_scaling_orig_ctx_len(original)
    if arch == "deepseek2":
        _deepseek2_metadata(w, config, kv_b)
    elif config.get("head_dim"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "yarn":  # TextModel.set_gguf_parameters; Olmo2Model's for OLMo 3
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if config["model_type"] == "olmo3":
            w.add_rope_scaling_attn_factors(rope["attention_factor"])
        elif rope.get("attention_factor") is not None:
            w.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
        if rope.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if rope.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    # TextModel.set_gguf_parameters (num_local_experts / num_experts, num_experts_per_tok); Qwen2MoeModel's widths
    if (experts := config.get("num_local_experts", config.get("num_experts"))) is not None:
        w.add_expert_count(experts)
        w.add_expert_used_count(config["num_experts_per_tok"])
    if arch in ("qwen2moe", "qwen3moe"):
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size") is not None:
            w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if arch == "granitemoe" and config.get("shared_intermediate_size"):  # GraniteMoeModel.set_gguf_parameters
        w.add_expert_shared_feed_forward_length(config["shared_intermediate_size"])
    if arch == "gpt-oss":  # GptOssModel.set_gguf_parameters
        w.add_sliding_window(config["sliding_window"])
        w.add_expert_feed_forward_length(config["intermediate_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_tokenizer(w, model_dir, config["vocab_size"])
    for key, (value, vtype) in (metadata or {}).items():
        w.add_key_value(key, value, vtype)
    for key in drop:
        del w.kv_data[0][key]

    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), layers)
    tensors, raw_tensors = {}, {}
    checkpoint = load_file(model_dir / "model.safetensors")
    if arch == "gpt-oss":
        checkpoint, raw_tensors = _gpt_oss_tensors(checkpoint, names)
    if arch == "deepseek2":
        checkpoint = _deepseek2_tensors(checkpoint, config, kv_b)
    if arch == "granitemoe":
        checkpoint = _granite_moe_tensors(checkpoint, config)
    for hf_name, array in _stacked_experts(checkpoint).items():
        stem, suffix = hf_name.rsplit(".", 1)
        if arch in GEMMA_ARCHS and hf_name == "lm_head.weight":
            continue  # GemmaModel.modify_tensors (and the others alike) skip it
        if names.get_name(stem) is None:  # ModelBase.map_tensor_name
            raise ValueError(f"Can not map tensor {hf_name!r}")
        gguf_name = f"{names.get_name(stem)}.{suffix}"
        if arch in GEMMA_ARCHS and hf_name.endswith("norm.weight"):
            array = array + np.float32(1)  # GemmaModel.modify_tensors, Gemma3Model.norm_shift
        if arch in ("llama", "granite", "granitemoe", "smollm3") and stem.endswith("q_proj"):
            array = llama_cpp_permute(array, heads, heads)
        elif arch in ("llama", "granite", "granitemoe", "smollm3") and stem.endswith("k_proj"):
            array = llama_cpp_permute(array, heads, kv_heads)
        tensors[gguf_name] = array.astype(np.float32)
    if rope.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_factors(rope, theta, head_dim)
    if rope.get("rope_type") == "longrope":
        tensors["rope_factors_long.weight"] = np.asarray(rope["long_factor"], np.float32)
        tensors["rope_factors_short.weight"] = np.asarray(rope["short_factor"], np.float32)
    tensors.update(extra_tensors or {})
    for gguf_name, raw in raw_tensors.items():
        w.add_tensor(gguf_name, raw, raw_dtype=T.MXFP4)
    for gguf_name, array in tensors.items():
        if gguf_name in skip:
            continue
        kind = matrix_type(gguf_name) if callable(matrix_type) else matrix_type
        if array.ndim == 1 or kind == "F32":
            w.add_tensor(gguf_name, array)
        elif kind == "F16":
            w.add_tensor(gguf_name, array.astype(np.float16))
        else:
            try:
                raw = gguf.quantize(array, T[kind])
            except NotImplementedError:  # a type gguf-py cannot write (Q8_1, Q8_K): zero blocks of its size
                raw = np.zeros(gguf.quant_shape_to_byte_shape(array.shape, T[kind]), np.uint8)
            w.add_tensor(gguf_name, raw, raw_dtype=T[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _deepseek2_metadata(w: gguf.GGUFWriter, config: dict, kv_b: str) -> None:
    """DeepseekV2Model.set_gguf_parameters (and TextModel's expert and group keys) in either form."""
    heads, rank, rope = config["num_attention_heads"], config["kv_lora_rank"], config["qk_rope_head_dim"]
    qk, v_head = config["qk_nope_head_dim"] + rope, config["v_head_dim"]
    if kv_b == "split":  # the latent attention as multi-query attention over [latent | rotary key]
        w.add_head_count_kv(1)
        w.add_key_length(rank + rope)
        w.add_value_length(rank)
        w.add_key_length_mla(qk)
        w.add_value_length_mla(v_head)
    else:
        w.add_head_count_kv(config.get("num_key_value_heads") or heads)
        w.add_key_length(qk)
        w.add_value_length(v_head)
    w.add_leading_dense_block_count(config.get("first_k_dense_replace") or 0)
    if config.get("q_lora_rank") is not None:
        w.add_q_lora_rank(config["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    w.add_expert_count(config["n_routed_experts"])
    w.add_expert_used_count(config["num_experts_per_tok"])
    w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    w.add_expert_shared_count(config.get("n_shared_experts") or 0)
    if config.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(config["routed_scaling_factor"])
    if config.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    scoring = config.get("scoring_func", "sigmoid" if config["model_type"] == "deepseek_v3" else "softmax")
    sigmoid = scoring == "sigmoid"
    if kv_b == "split" or sigmoid:
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
    if kv_b == "split" and config.get("n_group") is not None:
        w.add_expert_group_count(config["n_group"])
        w.add_expert_group_used_count(config["topk_group"])
    w.add_rope_dimension_count(rope)
    params = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if params.get("mscale_all_dim") is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * params["mscale_all_dim"])


def _deepseek2_tensors(checkpoint: dict[str, np.ndarray], config: dict, kv_b: str) -> dict[str, np.ndarray]:
    """DeepseekV2Model.modify_tensors: the router's e_score_correction_bias under the name gguf-py maps to
    exp_probs_b, multi-token-prediction layers left out, and in the split form kv_b_proj as k_b_proj (each head's
    key rows, transposed) and v_b_proj (its value rows)."""
    heads, nope, v_head = config["num_attention_heads"], config["qk_nope_head_dim"], config["v_head_dim"]
    out = {}
    for name, array in checkpoint.items():
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m and int(m[1]) >= config["num_hidden_layers"]:
            continue
        if name.endswith("e_score_correction_bias"):
            out[name.replace("e_score_correction_bias", "e_score_correction.bias")] = array
        elif kv_b == "split" and name.endswith("kv_b_proj.weight"):
            per_head = array.reshape(heads, nope + v_head, array.shape[-1])
            out[name.replace("kv_b_proj", "k_b_proj")] = np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1))
            out[name.replace("kv_b_proj", "v_b_proj")] = np.ascontiguousarray(per_head[:, nope:])
        else:
            out[name] = array
    return out


def _gpt_oss_tensors(checkpoint: dict[str, np.ndarray], names) -> tuple[dict, dict[str, np.ndarray]]:
    """GptOssModel.modify_tensors / generate_extra_tensors: the checkpoint with its sinks renamed and its experts as
    per-projection [E, out, in] stacks (and biases), and the MXFP4 stacks as raw GGML blocks by GGUF name."""
    out, raw, mxfp4 = {}, {}, {}
    for name, array in checkpoint.items():
        m = re.match(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$", name)
        if name.endswith("self_attn.sinks"):
            out[name + ".weight"] = array
        elif m is None:
            out[name] = array
        elif m[3] in ("_blocks", "_scales"):
            mxfp4.setdefault((m[1], m[2]), {})[m[3]] = array
        else:
            matrix = array if m[3] == "_bias" else array.transpose(0, 2, 1)  # [E, in, out] -> [E, out, in]
            suffix = "bias" if m[3] == "_bias" else "weight"
            if m[2] == "gate_up_proj":
                out[f"{m[1]}.gate_proj.{suffix}"], out[f"{m[1]}.up_proj.{suffix}"] = matrix[:, 0::2], matrix[:, 1::2]
            else:
                out[f"{m[1]}.down_proj.{suffix}"] = matrix
    for (stem, proj), parts in mxfp4.items():
        blocks, scales = parts["_blocks"], parts["_scales"]  # [E, out, G, 16], [E, out, G]
        codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
        ggml = (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)
        packed = np.concatenate([scales[..., None], ggml], axis=-1).reshape(*blocks.shape[:2], -1)  # [E, out, G*17]
        splits = {"gate_proj": packed[:, 0::2], "up_proj": packed[:, 1::2]} if proj == "gate_up_proj" else {
            "down_proj": packed}
        for part, data in splits.items():
            raw[f"{names.get_name(f'{stem}.{part}')}.weight"] = np.ascontiguousarray(data)
    return out, raw


def _granite_moe_tensors(checkpoint: dict[str, np.ndarray], config: dict) -> dict[str, np.ndarray]:
    """GraniteMoeModel.modify_tensors: each input_linear (the experts' stack, or the shared MLP's) split into its gate
    and up rows, under the names gguf-py maps to ffn_{gate,up}_exps and ffn_{gate,up}_shexp."""
    out = {}
    for name, array in checkpoint.items():
        m = re.match(r"(model\.layers\.\d+\.)(block_sparse_moe|shared_mlp)\.input_linear\.weight$", name)
        if m is None:
            out[name] = array
            continue
        stacked = m[2] == "block_sparse_moe"
        width = config["intermediate_size" if stacked else "shared_intermediate_size"]
        gate, up = np.split(array, [width], axis=-2)
        dest = f"{m[1]}mlp.{'experts' if stacked else 'shared_expert'}"
        out[f"{dest}.gate_proj.weight"], out[f"{dest}.up_proj.weight"] = gate, up
    return out


def _stacked_experts(checkpoint: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The checkpoint with each layer's experts stacked into one [experts, out, in] tensor per projection, named
    without the expert index (Qwen2MoeModel.modify_tensors' mlp.experts.down_proj ..., LlamaModel's
    block_sparse_moe.experts.w1 ... for Mixtral), which gguf-py maps to ffn_*_exps."""
    out, stacks = {}, {}
    for name, array in checkpoint.items():
        m = re.match(r"(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)\.weight$", name)
        if m is None:
            out[name] = array
        else:
            stacks.setdefault(f"{m[1]}.{m[3]}.weight", {})[int(m[2])] = array
    for name, parts in stacks.items():
        out[name] = np.stack([parts[e] for e in range(len(parts))])
    return out


def _add_tokenizer(w: gguf.GGUFWriter, model_dir: Path, vocab_size: int) -> None:
    """The byte-level BPE tokenizer beside the checkpoint, as _set_vocab_gpt2 writes one."""
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    by_id = {i: t for t, i in tokenizer["model"]["vocab"].items()}
    special = {t["id"]: t["content"] for t in tokenizer["added_tokens"] if t["special"]}
    by_id.update(special)
    tokens, types = [], []
    for i in range(vocab_size):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    ids = {content: i for i, content in special.items()}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(ids[tokenizer_config["bos_token"]])
    w.add_eos_token_id(ids[tokenizer_config["eos_token"]])
    w.add_pad_token_id(ids[tokenizer_config["pad_token"]])
    w.add_add_bos_token(False)
    template = tokenizer_config.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    if template:
        w.add_chat_template(template)
