"""DeepSeek-V2/V3 checkpoints seen in the layout the latent attention (jserve.models.mla) computes in, without
copying them.

The rotary rows are the last qk_rope_head_dim rows of each head's query (q_proj, or q_b_proj) and of
kv_a_proj_with_mqa (after the kv_lora_rank latent rows). DeepSeek rotates them in interleaved pairs (2i, 2i + 1)
(V2 always, V3 unless rope_interleave is false); each is reordered into halves (i, i + rope / 2), the pairs the
model rotates, which leaves every q . k unchanged because queries and keys are reordered alike. YaRN's attention
factor (transformers scales cos and sin by it) multiplies those rows too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import numpy as np

from checkpoints import CheckpointError
from checkpoints.tensor_views import RowView, interleaved_order

_QUERY = re.compile(r"model\.layers\.\d+\.self_attn\.(q_proj|q_b_proj)\.weight$")
_LATENT = re.compile(r"model\.layers\.\d+\.self_attn\.kv_a_proj_with_mqa\.(weight|bias)$")


def deepseek_tensors(tensors: Iterable[tuple[str, object, str]], config) -> Iterator[tuple[str, object, str]]:
    """(name, tensor, origin) with the rotary rows reordered and scaled (see the module doc). config: the model's
    ModelConfig (its latent-attention fields, rotary_interleaved and rope_attention_factor)."""
    nope, rope, rank = config.qk_nope_head_dim, config.qk_rope_head_dim, config.kv_lora_rank
    order = interleaved_order(rope, rope) if config.rotary_interleaved else np.arange(rope)
    factor = float(config.rope_attention_factor)
    if factor == 1.0 and not config.rotary_interleaved:
        yield from tensors
        return

    def rows(tensor, name: str, origin: str, lead: int, width: int) -> RowView:
        if tensor.shape[0] % width:
            raise CheckpointError(f"{origin}: tensor {name} has {tensor.shape[0]} rows, not whole heads of {width}")
        blocks = tensor.shape[0] // width
        within = np.concatenate([np.arange(lead), lead + order])
        scale = np.tile(np.where(np.arange(width) < lead, 1.0, factor).astype(np.float32), blocks)
        return RowView(tensor, (np.arange(blocks)[:, None] * width + within).reshape(-1),
                       None if factor == 1.0 else scale)

    for name, tensor, origin in tensors:
        if _QUERY.match(name):
            tensor = rows(tensor, name, origin, nope, nope + rope)
        elif _LATENT.match(name):
            tensor = rows(tensor, name, origin, rank, rank + rope)
        yield name, tensor, origin
