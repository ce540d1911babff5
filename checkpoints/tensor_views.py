"""Checkpoint tensors seen in the layout the Llama-family state is assembled from, without copying them.

- Phi-3 stores q, k and v as one `qkv_proj` and gate and up as one `gate_up_proj`: each is split into its parts,
  which the loader then fuses again in its own layout (fused_row_map: one block of whole heads a tensor-parallel
  shard, KV heads replicated where the shards outnumber them).
- Partial rotary embedding (partial_rotary_factor < 1) rotates the first rotary_dim dimensions of each head, in
  pairs (i, i + rotary_dim / 2), and passes the rest through. The model rotates whole heads in pairs
  (i, i + head_dim / 2), so each head's q and k rows are reordered: the first rotated half, the first half of the
  passed-through dimensions, the second rotated half, the second passed-through half. The passed-through pairs then
  meet frequency 0 (rope_inv_freq pads with zeros), which leaves them as they are, and q . k is unchanged because
  q and k are reordered alike (v and the attention output are not touched).
- Longrope's and YaRN's attention factor multiplies the rotated dimensions of q and k (transformers scales cos and
  sin): it is folded into their rows (into q_norm and k_norm instead where the model normalizes q and k, which
  would undo it), in the layers that rotate by the scaled frequencies.
- Granite multiplies each layer's attention and MLP outputs by residual_multiplier and divides the logits by
  logits_scaling: folded into the o_proj and down_proj rows and into the final norm's weight.
- Gemma's RMSNorms multiply by (1 + weight): the 1 (norm_weight_offset) is added to every norm weight.
- GLM-4 rotates interleaved pairs (2i, 2i + 1): each head's q and k rows are reordered into halves first (then as
  partial rotary embedding above); its sandwich norms are renamed to Gemma 2's (post_self_attn_layernorm is the
  attention output's norm, post_attention_layernorm the MLP input's, post_mlp_layernorm the MLP output's).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import numpy as np

from checkpoints import CheckpointError

_FUSED = re.compile(r"(model\.layers\.\d+)\.(self_attn\.qkv_proj|mlp\.gate_up_proj)\.(weight|bias)$")
_ROTATED = re.compile(r"model\.layers\.(\d+)\.self_attn\.(q_proj|k_proj|q_norm|k_norm)\.(weight|bias)$")
# a mixture's down projections too (Granite MoE): its output is their weighted sum
_RESIDUAL = re.compile(r"model\.layers\.\d+\.(self_attn\.o_proj|mlp\.(experts\.(\d+\.)?|shared_experts?\.)?down_proj)"
                       r"\.(weight|bias)$")
# GLM-4 names its sandwich norms by place: the attention output's, the MLP input's and the MLP output's.
_GLM4_NORM = re.compile(r"(model\.layers\.\d+\.)(post_self_attn_layernorm|post_attention_layernorm|post_mlp_layernorm)"
                        r"\.weight$")
_GLM4_NORMS = {"post_self_attn_layernorm": "post_attention_layernorm",
               "post_attention_layernorm": "pre_feedforward_layernorm",
               "post_mlp_layernorm": "post_feedforward_layernorm"}
_NORM = re.compile(r"model\.(norm|layers\.\d+\.(\w+_layernorm|self_attn\.[qk]_norm))\.weight$")


def take(tensor, index: tuple, dtype: np.dtype) -> np.ndarray:
    """tensor[index] as a new array of dtype. A lazy tensor (one with `read`) decodes only that block."""
    if isinstance(tensor, np.ndarray):
        return np.asarray(tensor[index], dtype=dtype)
    return tensor.read(index, dtype)


class RowView:
    """Rows of a tensor, in a given order, each times an optional factor and plus an optional offset, read block by
    block on demand."""

    def __init__(self, tensor, rows: np.ndarray, scale: np.ndarray | None = None, offset: float = 0.0):
        self.tensor, self.rows, self.scale, self.offset = tensor, np.asarray(rows, np.int64), scale, offset
        self.shape = (len(self.rows), *tensor.shape[1:])

    def read(self, index: tuple, dtype: np.dtype) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(self.shape) - len(tuple(index)))
        rows = self.rows[index[0]]
        if self.scale is None and self.offset == 0.0:
            return take(self.tensor, (rows, *index[1:]), dtype)
        if np.issubdtype(np.dtype(dtype), np.integer):
            raise CheckpointError(f"cannot fold a scale factor or offset into stored {np.dtype(dtype)} rows")
        block = take(self.tensor, (rows, *index[1:]), np.dtype(np.float32)) + np.float32(self.offset)
        if self.scale is not None:
            block = block * self.scale[index[0]].reshape(-1, *[1] * (block.ndim - 1))
        return block.astype(dtype)


class StackRows:
    """Rows [start, start + count) of each matrix of a stack of experts' matrices, read block by block: of an
    [E, out, in] stack, or (transposed) of an [E, in, out] one, whose columns are then the rows read, giving
    [E, count, in] either way."""

    def __init__(self, tensor, start: int, count: int, transposed: bool = False):
        self.tensor, self.start, self.transposed = tensor, start, transposed
        self.shape = (tensor.shape[0], count, tensor.shape[1 if transposed else 2])

    def read(self, index: tuple, dtype: np.dtype) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (3 - len(tuple(index)))
        rows = np.arange(self.start, self.start + self.shape[1])[index[1]]
        if not self.transposed:
            return take(self.tensor, (index[0], rows, index[2]), dtype)
        return np.ascontiguousarray(take(self.tensor, (index[0], index[2], rows), dtype).transpose(0, 2, 1))


def interleaved_order(head_dim: int, rotary_dim: int) -> np.ndarray:
    """Where each row of a head comes from so that interleaved rotary pairs (2i, 2i + 1) become halves
    (i, i + rotary_dim / 2); the passed-through rows stay."""
    half = rotary_dim // 2
    return np.concatenate([2 * np.arange(half), 2 * np.arange(half) + 1, np.arange(rotary_dim, head_dim)])


def rotary_order(head_dim: int, rotary_dim: int) -> np.ndarray:
    """Where each row of a head comes from so that partial rotary pairs become whole-head pairs (see above)."""
    half, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return np.concatenate([np.arange(half), rotary_dim + np.arange(rest), half + np.arange(half),
                           rotary_dim + rest + np.arange(rest)])


def llama_layout(tensors: Iterable[tuple[str, object, str]], config) -> Iterator[tuple[str, object, str]]:
    """(name, tensor, origin) of a checkpoint as the Llama family names and lays them out (see the module doc).
    config: the model's CheckpointShape; its rotary_dims and rope_attention_factor (where it has them) say what to
    reorder and scale."""
    head_dim = config.head_dim
    rotary_dim = getattr(config, "rotary_dims", head_dim)
    factor = float(getattr(config, "rope_attention_factor", 1.0))
    qk_norm = bool(getattr(config, "qk_norm", False) or getattr(config, "qk_norm_across_heads", False))
    order = rotary_order(head_dim, rotary_dim)
    rotated = order < rotary_dim
    interleaved = bool(getattr(config, "rotary_interleaved", False))
    if interleaved:
        order = interleaved_order(head_dim, rotary_dim)[order]
    glm4 = getattr(config, "model_type", None) == "glm4"
    sizes = {"self_attn.qkv_proj": (("q_proj", config.q_size), ("k_proj", config.kv_size // config.kv_head_replicas),
                                    ("v_proj", config.kv_size // config.kv_head_replicas)),
             "mlp.gate_up_proj": (("gate_proj", config.intermediate_size), ("up_proj", config.intermediate_size))}

    residual = float(getattr(config, "residual_multiplier", 1.0))
    logits = float(getattr(config, "logits_scaling", 1.0))
    norm_offset = float(getattr(config, "norm_weight_offset", 0.0))

    def scaled(name: str, tensor, origin: str) -> tuple[str, object, str]:
        if norm_offset and _NORM.match(name):
            tensor = RowView(tensor, np.arange(tensor.shape[0]), offset=norm_offset)
        multiplier = residual if _RESIDUAL.match(name) else 1 / logits if name == "model.norm.weight" else 1.0
        if multiplier == 1.0:
            return rotary(name, tensor, origin)
        rows = np.arange(tensor.shape[0])
        return name, RowView(tensor, rows, np.full(tensor.shape[0], multiplier, np.float32)), origin

    latent = bool(getattr(config, "kv_lora_rank", 0))  # DeepSeek's rotary rows: checkpoints.deepseek

    def rotary(name: str, tensor, origin: str) -> tuple[str, object, str]:
        m = _ROTATED.match(name)
        if m is None or latent or (rotary_dim == head_dim and factor == 1.0 and not interleaved):
            return name, tensor, origin
        is_norm = m[2].endswith("norm")
        # the factor scales the global rotary embedding alone: not a layer that rotates by a local base, unscaled
        # (OLMo 3's windowed layers), or not at all
        scaled = getattr(config, "layer_rotary", lambda layer: 0)(int(m[1])) == 0
        fold = factor != 1.0 and is_norm == qk_norm and scaled
        if tensor.shape[0] % head_dim:
            raise CheckpointError(f"{origin}: tensor {name} has {tensor.shape[0]} rows, not whole heads of "
                                  f"{head_dim}")
        heads = tensor.shape[0] // head_dim
        rows = (np.arange(heads)[:, None] * head_dim + order[None, :]).reshape(-1)
        scale = np.tile(np.where(rotated, factor, 1.0).astype(np.float32), heads) if fold else None
        return name, RowView(tensor, rows, scale), origin

    for name, tensor, origin in tensors:
        if glm4 and (n := _GLM4_NORM.match(name)):
            name = f"{n[1]}{_GLM4_NORMS[n[2]]}.weight"
        m = _FUSED.match(name)
        if m is None:
            yield scaled(name, tensor, origin)
            continue
        parts = sizes[m[2]]
        expected = sum(n for _, n in parts)
        if tensor.shape[0] != expected:
            raise CheckpointError(f"{origin}: tensor {name} has shape {list(tensor.shape)}, expected {expected} rows "
                                  f"({' + '.join(f'{p} {n}' for p, n in parts)}) from the model's configuration")
        start = 0
        block = m[2].split(".")[0]
        for part, n in parts:
            yield rotary(f"{m[1]}.{block}.{part}.{m[3]}", RowView(tensor, np.arange(start, start + n)), origin)
            start += n
