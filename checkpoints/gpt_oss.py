"""gpt-oss checkpoints seen in the layout the Llama-family state is assembled from, without copying them.

transformers' GptOss names the MoE's router `mlp.router` (the others' `mlp.gate`) and stores each layer's experts as
four stacked tensors: `gate_up_proj` [E, hidden, 2 x width], whose columns interleave gate and up (gate 0::2, up
1::2), its bias [E, 2 x width], `down_proj` [E, width, hidden] and its bias [E, hidden]. The matrices are [in, out],
the transpose of every other projection's [out, in]. OpenAI's published checkpoints store the two matrices in MXFP4
(the OCP microscaling format): `<name>_blocks` uint8 [E, out, in / 32, 16], two 4-bit E2M1 values a byte (the low
nibble first), and `<name>_scales` uint8 [E, out, in / 32], each block of 32 values' power-of-two exponent biased
by 127; those are [out, in] already. Each is read as the per-projection stacks the model holds ([E, out, in] and
[E, out]), block by block, dequantized as transformers' convert_moe_packed_tensors does.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import numpy as np

from checkpoints import CheckpointError
from checkpoints.tensor_views import take

# The 16 values of an E2M1 nibble (sign bit 3, two exponent bits, one mantissa bit).
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
MXFP4_BLOCK = 32  # values sharing one scale

_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.)experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
_ROUTER = re.compile(r"(model\.layers\.\d+\.mlp\.)router\.(weight|bias)$")


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 blocks uint8 [..., G, 16] with their scales uint8 [..., G] -> float32 [..., G * 32]."""
    blocks = np.asarray(blocks, np.uint8)
    values = np.empty((*blocks.shape[:-1], 2 * blocks.shape[-1]), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, (np.asarray(scales, np.int32) - 127)[..., None])
    return values.reshape(*blocks.shape[:-2], -1)


class ExpertView:
    """One projection's expert stack from a gpt-oss tensor, read block by block: rows part::parts of the tensor's
    output axis (gate 0 and up 1 of the interleaved gate_up; 0 of 1 for down), as weight [E, out, in] or bias
    [E, out]. tensor: a bias [E, out'], a matrix [E, in, out'] (transposed here), or MXFP4 blocks with `scales`."""

    def __init__(self, tensor, *, part: int = 0, parts: int = 1, scales=None):
        self.tensor, self.part, self.parts, self.scales = tensor, part, parts, scales
        if scales is not None:
            experts, out, groups, _ = tensor.shape
            self.shape = (experts, out // parts, groups * MXFP4_BLOCK)
        elif len(tensor.shape) == 3:
            experts, width, out = tensor.shape
            self.shape = (experts, out // parts, width)
        else:
            self.shape = (tensor.shape[0], tensor.shape[1] // parts)

    def read(self, index: tuple, dtype: np.dtype) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(self.shape) - len(tuple(index)))
        rows = np.arange(self.shape[1])[index[1]] * self.parts + self.part  # the checkpoint's output rows
        if len(self.shape) == 2:
            return take(self.tensor, index[:1], np.dtype(np.float32))[:, rows].astype(dtype)
        if self.scales is None:  # [E, in, out]: the selected columns, transposed
            block = take(self.tensor, (index[0], index[2]), np.dtype(dtype))
            return np.ascontiguousarray(block[:, :, rows].transpose(0, 2, 1))
        blocks = take(self.tensor, index[:1], np.dtype(np.uint8))[:, rows]
        scales = take(self.scales, index[:1], np.dtype(np.uint8))[:, rows]
        return dequantize_mxfp4(blocks, scales)[:, :, index[2]].astype(dtype)


def gpt_oss_tensors(tensors: Iterable[tuple[str, object, str]]) -> Iterator[tuple[str, object, str]]:
    """(name, tensor, origin) of a gpt-oss checkpoint under the names the other mixtures of experts use: mlp.gate for
    the router, mlp.experts.{gate,up,down}_proj.{weight,bias} as whole expert stacks."""
    pending: dict[str, dict[str, tuple[object, str]]] = {}  # an MXFP4 matrix's blocks or scales, awaiting the other
    for name, tensor, origin in tensors:
        if m := _ROUTER.match(name):
            yield f"{m[1]}gate.{m[2]}", tensor, origin
            continue
        m = _EXPERTS.match(name)
        if m is None:
            yield name, tensor, origin
            continue
        prefix, proj, kind = m[1], m[2], m[3] or ""
        if kind in ("_blocks", "_scales"):
            halves = pending.setdefault(prefix + proj, {})
            halves[kind] = (tensor, origin)
            if len(halves) < 2:
                continue
            del pending[prefix + proj]
            (blocks, _), (scales, _) = halves["_blocks"], halves["_scales"]
            if len(blocks.shape) != 4 or blocks.shape[-1] != MXFP4_BLOCK // 2 or \
                    tuple(blocks.shape[:-1]) != tuple(scales.shape):
                raise CheckpointError(f"{origin}: {prefix}experts.{proj}_blocks {list(blocks.shape)} and _scales "
                                      f"{list(scales.shape)} are not MXFP4 blocks [E, out, in/32, 16] with scales "
                                      "[E, out, in/32]")
            source, suffix = {"tensor": blocks, "scales": scales}, "weight"
        else:
            source, suffix = {"tensor": tensor}, "bias" if kind == "_bias" else "weight"
        if proj == "gate_up_proj":
            yield f"{prefix}experts.gate_proj.{suffix}", ExpertView(part=0, parts=2, **source), origin
            yield f"{prefix}experts.up_proj.{suffix}", ExpertView(part=1, parts=2, **source), origin
        else:
            yield f"{prefix}experts.down_proj.{suffix}", ExpertView(**source), origin
    for name, halves in pending.items():
        have = next(iter(halves))
        missing = "_scales" if have == "_blocks" else "_blocks"
        raise CheckpointError(f"{halves[have][1]}: {name}{have} has no {name}{missing}")
