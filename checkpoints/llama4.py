"""Llama 4 checkpoints (Llama4ForCausalLM, and the language model of Llama4ForConditionalGeneration) seen in the
layout the other mixtures of experts are assembled from, without copying them.

A layer's MLP is `feed_forward`: a dense one (`feed_forward.{gate,up,down}_proj`), or a mixture of experts with its
router `feed_forward.router`, its ungated `feed_forward.shared_expert` and its experts as two stacks stored
[in, out]: `feed_forward.experts.gate_up_proj` [experts, hidden, 2 x width] (gate columns, then up columns) and
`feed_forward.experts.down_proj` [experts, width, hidden]. They are read as `mlp.*`, the experts as the
[experts, out, in] stacks `mlp.experts.{gate,up,down}_proj`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from checkpoints import CheckpointError
from checkpoints.tensor_views import StackRows

_FEED_FORWARD = re.compile(r"(model\.layers\.\d+\.)feed_forward\.(.+)$")


def llama4_tensors(tensors: Iterable[tuple[str, object, str]]) -> Iterator[tuple[str, object, str]]:
    """(name, tensor, origin) under the names the Llama family's MLP and the other mixtures of experts use."""
    for name, tensor, origin in tensors:
        m = _FEED_FORWARD.match(name)
        if m is None:
            yield name, tensor, origin
            continue
        prefix, rest = m[1], m[2]
        if rest == "router.weight":
            yield f"{prefix}mlp.gate.weight", tensor, origin
        elif rest in ("experts.gate_up_proj", "experts.down_proj"):
            if len(tensor.shape) != 3 or (rest == "experts.gate_up_proj" and tensor.shape[2] % 2):
                raise CheckpointError(f"{origin}: {name} has shape {list(tensor.shape)}, not a stack of experts' "
                                      "[in, out] matrices (gate_up_proj: gate and up columns)")
            if rest == "experts.down_proj":
                down = StackRows(tensor, 0, tensor.shape[2], transposed=True)
                yield f"{prefix}mlp.experts.down_proj.weight", down, origin
                continue
            half = tensor.shape[2] // 2
            yield f"{prefix}mlp.experts.gate_proj.weight", StackRows(tensor, 0, half, transposed=True), origin
            yield f"{prefix}mlp.experts.up_proj.weight", StackRows(tensor, half, half, transposed=True), origin
        else:  # the dense MLP's and the shared expert's projections
            yield f"{prefix}mlp.{rest}", tensor, origin
