"""Granite MoE checkpoints (GraniteMoeForCausalLM, GraniteMoeSharedForCausalLM) seen in the layout the other
mixtures of experts are assembled from, without copying them.

Each layer's experts are two stacks: `block_sparse_moe.input_linear` [E, 2 x width, hidden], gate rows then up
rows, and `block_sparse_moe.output_linear` [E, hidden, width], the down projections; the router is
`block_sparse_moe.router.layer`. GraniteMoeShared adds an ungated shared MLP, `shared_mlp.input_linear` [2 x shared,
hidden] (gate then up) and `shared_mlp.output_linear`. They are read as `mlp.experts.{gate,up,down}_proj` stacks,
`mlp.gate` and `mlp.shared_expert.{gate,up,down}_proj`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import numpy as np

from checkpoints import CheckpointError
from checkpoints.tensor_views import RowView, StackRows

_GRANITE_MOE = re.compile(r"(model\.layers\.\d+\.)(block_sparse_moe\.(input_linear|output_linear|router\.layer)|"
                          r"shared_mlp\.(input_linear|output_linear))\.weight$")


def granite_moe_tensors(tensors: Iterable[tuple[str, object, str]]) -> Iterator[tuple[str, object, str]]:
    """(name, tensor, origin) under the names Qwen-MoE's experts, router and shared expert use."""
    for name, tensor, origin in tensors:
        m = _GRANITE_MOE.match(name)
        if m is None:
            yield name, tensor, origin
            continue
        prefix, experts, shared = m[1], m[3], m[4]
        if experts == "router.layer":
            yield f"{prefix}mlp.gate.weight", tensor, origin
            continue
        stacked = experts is not None
        dest = f"{prefix}mlp.{'experts' if stacked else 'shared_expert'}"
        if (experts or shared) == "output_linear":
            yield f"{dest}.down_proj.weight", tensor, origin
            continue
        rows = tensor.shape[1 if stacked else 0]
        if len(tensor.shape) != (3 if stacked else 2) or rows % 2:
            raise CheckpointError(f"{origin}: {name} has shape {list(tensor.shape)}, not gate and up rows of "
                                  f"{'[experts, 2 x width, hidden]' if stacked else '[2 x width, hidden]'}")
        half = rows // 2
        for part, start in (("gate_proj", 0), ("up_proj", half)):
            view = StackRows(tensor, start, half) if stacked else RowView(tensor, np.arange(start, start + half))
            yield f"{dest}.{part}.weight", view, origin
