"""llama.cpp's `deepseek2` GGUF files (DeepSeek-V2, V2-Lite, V2.5, V3, R1, Moonlight, DeepSeek-Coder-V2) read as
the config.json and the Hugging Face tensors jserve's DeepSeek models load (jserve.gguf_loading's module docstring
says what is llama.cpp's convention and what is undone)."""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np

from checkpoints.gguf_reader import GGUFFile, GGUFTensor
from jserve.config import ModelLoadError

ARCH = "deepseek2"
# gguf-py's tensor_mapping for DEEPSEEK2, as Hugging Face names the tensors (exp_probs_b, the V3 router's selection
# bias, is named apart: its Hugging Face name ends in `_bias`, not `.bias`)
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
SELECTION_BIAS = "exp_probs_b"
_SPLIT_KV_B = re.compile(r"blk\.(\d+)\.attn_([kv])_b\.weight$")
# llama-hparams' expert gating functions (LLAMA_EXPERT_GATING_FUNC_TYPE_*): 0 is none, read as softmax for deepseek2
_SOFTMAX, _SIGMOID = 1, 2
_REQUIRED = object()


def deepseek2_fields(file: GGUFFile, cfg: dict, rope_scaling: Callable[[GGUFFile, str, int], dict | None]) -> dict:
    """The config.json fields of a deepseek2 file beyond those every architecture has (cfg), as llama.cpp's
    load_hparams and llm_build_deepseek2 read the file; rope_scaling: gguf_loading's reading of a scaling other
    than YaRN."""

    def key(name: str, default=_REQUIRED):
        value = file.get(f"{ARCH}.{name}", default)
        if value is _REQUIRED:
            raise ModelLoadError(f"{file.path}: GGUF metadata has no {ARCH}.{name} (a deepseek2 model needs it)")
        return value

    tensors = file.tensors
    heads = cfg["num_attention_heads"]
    rank, rope = int(key("attention.kv_lora_rank")), int(key("rope.dimension_count"))
    split = "blk.0.attn_k_b.weight" in tensors
    if split and key("attention.key_length_mla", None) is None:
        raise ModelLoadError(f"{file.path}: attn_k_b / attn_v_b tensors without {ARCH}.attention.key_length_mla "
                             "and value_length_mla (the heads' widths)")
    # llama.cpp's n_embd_head_k_mla / n_embd_head_v_mla: the *_mla keys where the file has them (kv_b split into
    # k_b and v_b), else the heads' own key_length / value_length (a file with the whole attn_kv_b)
    qk = int(key("attention.key_length_mla", 0) or key("attention.key_length", 0) or cfg["hidden_size"] // heads)
    v_head = int(key("attention.value_length_mla", 0) or key("attention.value_length", 0) or qk)
    if not 0 < rope < qk or rope % 2:
        raise ModelLoadError(f"{file.path}: {ARCH}.rope.dimension_count {rope} must be even and below the query "
                             f"head's {qk} dimensions")
    q_rank = int(key("attention.q_lora_rank", 0) or 0)
    if not q_rank and "blk.0.attn_q_a.weight" in tensors:  # llama.cpp takes low-rank queries by their tensors
        q_rank = tensors["blk.0.attn_q_a.weight"].shape[0]
    if float(key("attention.temperature_scale", 0.0) or 0.0):
        raise ModelLoadError(f"{file.path}: {ARCH}.attention.temperature_scale (llama.cpp's query temperature "
                             "tuning) is not supported")
    gating = int(key("expert_gating_func", 0) or 0) or _SOFTMAX  # llama.cpp: none is softmax (older V2 files)
    if gating not in (_SOFTMAX, _SIGMOID):
        raise ModelLoadError(f"{file.path}: {ARCH}.expert_gating_func {gating} is not supported (1: softmax, as "
                             "DeepSeek-V2's; 2: sigmoid, as DeepSeek-V3's)")
    has_bias = any(name.endswith(f".{SELECTION_BIAS}.bias") for name in tensors)
    if gating == _SOFTMAX and has_bias:
        raise ModelLoadError(f"{file.path}: {SELECTION_BIAS} (an expert selection bias) with softmax gating "
                             f"({ARCH}.expert_gating_func); jserve serves it with sigmoid gating (2) only")
    experts, used = int(key("expert_count")), int(key("expert_used_count"))
    groups = int(key("expert_group_count", 1) or 1)
    used_groups = int(key("expert_group_used_count", 0) or 0) if groups > 1 else 1
    if groups > 1 and not 0 < used_groups <= groups:
        raise ModelLoadError(f"{file.path}: {ARCH}.expert_group_count {groups} needs expert_group_used_count between "
                             f"1 and {groups}, got {used_groups}")
    if gating == _SOFTMAX and used_groups < groups:
        raise ModelLoadError(
            f"{file.path}: {ARCH}.expert_group_count {groups} with expert_group_used_count {used_groups} under softmax "
            "gating is not supported: llama.cpp ranks the groups by their two best scores' sum, DeepSeek-V2's "
            "group_limited_greedy (jserve's) by their best score")
    scale = float(key("expert_weights_scale", 0.0) or 0.0)  # llama.cpp scales by neither 0 nor an absent scale
    out = {"model_type": "deepseek_v3" if gating == _SIGMOID else "deepseek_v2",
           "num_key_value_heads": heads, "kv_lora_rank": rank, "q_lora_rank": q_rank or None,
           "qk_nope_head_dim": qk - rope, "qk_rope_head_dim": rope, "v_head_dim": v_head,
           "n_routed_experts": experts, "num_experts_per_tok": used,
           "moe_intermediate_size": int(key("expert_feed_forward_length")),
           "n_shared_experts": int(key("expert_shared_count")),
           "first_k_dense_replace": int(key("leading_dense_block_count")), "moe_layer_freq": 1,
           "routed_scaling_factor": scale or 1.0, "norm_topk_prob": bool(key("expert_weights_norm", False)),
           "n_group": groups if gating == _SIGMOID else 1, "topk_group": used_groups if gating == _SIGMOID else 1,
           "rope_scaling": _rope(file, rope, rope_scaling)}
    if gating == _SOFTMAX:
        out["topk_method"] = "greedy"
    else:  # llama.cpp rotates every file's rotary dimensions in adjacent pairs
        out["rope_interleave"] = True
    return out


def _rope(file: GGUFFile, rope: int, rope_scaling: Callable[[GGUFFile, str, int], dict | None]) -> dict | None:
    """YaRN as llama.cpp serves a deepseek2 file (llama-context's yarn_attn_factor, llm_build_deepseek2's kq_scale):
    the rotary embedding unscaled (DeepSeek's mscale taken equal to its mscale_all_dim, which the file does not
    store), the scores times mscale(factor, mscale_all_dim) squared, mscale_all_dim being yarn_log_multiplier / 0.1
    (the converter stores 0.1 * mscale_all_dim)."""
    prefix = f"{ARCH}.rope.scaling."
    if file.get(prefix + "type") != "yarn":
        return rope_scaling(file, ARCH, rope)
    extras = [k for k in ("yarn_ext_factor", "yarn_attn_factor", "attn_factor") if file.get(prefix + k) is not None]
    log_mul = file.get(prefix + "yarn_log_multiplier")
    if extras or not log_mul:
        raise ModelLoadError(f"{file.path}: deepseek2 YaRN " + (
            f"with {', '.join(prefix + k for k in extras)} is not supported" if extras else
            f"without {prefix}yarn_log_multiplier (DeepSeek's mscale_all_dim) is not supported"))
    original = file.get(prefix + "original_context_length")
    if original is None:
        raise ModelLoadError(f"{file.path}: YaRN rope scaling without {prefix}original_context_length")
    mscale = float(np.float32(log_mul) / np.float32(0.1))  # llama.cpp's division, in float32
    scaling = {"rope_type": "yarn", "factor": float(file.get(prefix + "factor", 1.0)),
               "original_max_position_embeddings": int(original), "mscale": mscale, "mscale_all_dim": mscale}
    for name in ("beta_fast", "beta_slow"):
        if (value := file.get(f"{prefix}yarn_{name}")) is not None:
            scaling[name] = float(value)
    return scaling


def latent_tensors(file: GGUFFile, config) -> dict[str, object]:
    """The file's tensors by GGUF name, with each layer's attn_k_b and attn_v_b read together as the attn_kv_b
    (Hugging Face's kv_b_proj) they were split from."""
    out, pairs = {}, {}
    for name, tensor in file.tensors.items():
        if m := _SPLIT_KV_B.match(name):
            pairs.setdefault(int(m[1]), {})[m[2]] = tensor
        else:
            out[name] = tensor
    for layer, pair in sorted(pairs.items()):
        if len(pair) != 2:
            have, lacks = ("k", "v") if "k" in pair else ("v", "k")
            raise ModelLoadError(f"{file.path}: blk.{layer}.attn_{have}_b.weight without blk.{layer}.attn_{lacks}_b"
                                 ".weight")
        out[f"blk.{layer}.attn_kv_b.weight"] = LatentKVB(pair["k"], pair["v"], config, file)
    return out


class LatentKVB:
    """kv_b_proj ([heads x (qk_nope + v_head), kv_lora_rank]: each head's key rows, then its value rows) read from
    llama.cpp's attn_k_b ([heads, kv_lora_rank, qk_nope]: each head's key rows transposed) and attn_v_b ([heads,
    v_head, kv_lora_rank]), one head's block at a time (checkpoints.gguf_reader decodes 2-D tensors)."""

    def __init__(self, k_b: GGUFTensor, v_b: GGUFTensor, config, file: GGUFFile):
        heads, rank = config.num_heads, config.kv_lora_rank
        self.nope, v_head = config.qk_nope_head_dim, config.v_head_dim
        for tensor, shape in ((k_b, (heads, rank, self.nope)), (v_b, (heads, v_head, rank))):
            if tuple(tensor.shape) != shape:
                raise ModelLoadError(f"{file.path}: tensor {tensor.name} has shape {list(tensor.shape)}, expected "
                                     f"{list(shape)} ([heads, kv_lora_rank, qk_nope] / [heads, v_head, kv_lora_rank])")
        self.shape, self.width = (heads * (self.nope + v_head), rank), self.nope + v_head
        self.type_name = k_b.type_name
        self.k, self.v = _heads(k_b), _heads(v_b)

    def read(self, index: tuple = (), dtype: np.dtype | type = np.float32) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (2 - len(tuple(index)))
        rows, cols = np.arange(self.shape[0])[index[0]], index[1]
        flat = np.atleast_1d(rows)
        width = len(range(*cols.indices(self.shape[1])))
        out = np.empty((len(flat), width), dtype)
        head, within = np.divmod(flat, self.width)
        for h in np.unique(head):
            chosen = np.flatnonzero(head == h)
            key = within[chosen] < self.nope
            if key.any():  # k_b[h] is [rank, nope]: the key rows are its columns
                out[chosen[key]] = self.k[h].read((cols,), dtype)[:, within[chosen[key]]].T
            if not key.all():
                out[chosen[~key]] = self.v[h].read((within[chosen[~key]] - self.nope, cols), dtype)
        return out.reshape(*np.shape(rows), width)


def _heads(tensor: GGUFTensor) -> list[GGUFTensor]:
    heads, rows = tensor.shape[:2]
    data = tensor.data.reshape(heads, rows, -1)
    return [GGUFTensor(f"{tensor.name}[{h}]", data[h], tensor.qtype, tuple(tensor.shape[1:])) for h in range(heads)]
