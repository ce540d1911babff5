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

import numpy as np

from checkpoints import CheckpointError
from checkpoints.tensor_views import take

_FEED_FORWARD = re.compile(r"(model\.layers\.\d+\.)feed_forward\.(.+)$")


class TransposedStack:
    """Columns [start, start + count) of an [E, in, out] stack, read as the [E, count, in] stack of their
    transposes, block by block."""

    def __init__(self, tensor, start: int, count: int):
        self.tensor, self.start = tensor, start
        self.shape = (tensor.shape[0], count, tensor.shape[1])

    def read(self, index: tuple, dtype: np.dtype) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (3 - len(tuple(index)))
        columns = np.arange(self.start, self.start + self.shape[1])[index[1]]
        block = take(self.tensor, (index[0], index[2], columns), dtype)  # [e, in, columns]
        return np.ascontiguousarray(block.transpose(0, 2, 1))


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
                yield f"{prefix}mlp.experts.down_proj.weight", TransposedStack(tensor, 0, tensor.shape[2]), origin
                continue
            half = tensor.shape[2] // 2
            yield f"{prefix}mlp.experts.gate_proj.weight", TransposedStack(tensor, 0, half), origin
            yield f"{prefix}mlp.experts.up_proj.weight", TransposedStack(tensor, half, half), origin
        else:  # the dense MLP's and the shared expert's projections
            yield f"{prefix}mlp.{rest}", tensor, origin
