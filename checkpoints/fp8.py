"""FP8 checkpoints seen as the float weights they stand for, dequantized block by block as they are read.

Two layouts are published, both float8_e4m3fn weights (`X.weight`) times float scales:
- Hugging Face's `fp8` (DeepSeek-V3/R1, Qwen3-*-FP8, ...): `X.weight_scale_inv` [ceil(out / bm), ceil(in / bn)],
  one scale a block of bm x bn weights (`weight_block_size` [bm, bn]; the last block of a row or column may be
  partial), or a single scale where the checkpoint has no blocks. Despite its name it multiplies: w = q * s.
- compressed-tensors' `float-quantized` (llm-compressor's FP8 / FP8-dynamic): `X.weight_scale`, one scale a row
  ([out, 1]), one a tensor ([1]), or one a block as above.
Static activation scales (`X.input_scale`, `X.activation_scale`) are not read: jserve keeps activations in float.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import ml_dtypes
import numpy as np

from checkpoints import CheckpointError
from checkpoints.tensor_views import take

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
ACTIVATION_SUFFIXES = (".input_scale", ".activation_scale")


class Fp8View:
    """A float8 weight [..., out, in] with its scales, read as float block by block: one scale a block of `block`
    (rows, columns), a row ([..., out, 1]) or the whole tensor ([] or [1])."""

    def __init__(self, tensor, scale: np.ndarray, block: tuple[int, int] | None, name: str, origin: str):
        self.tensor, self.shape = tensor, tuple(tensor.shape)
        scale = np.asarray(scale, np.float32)
        rows, cols = self.shape[-2:]
        lead = self.shape[:-2]
        if scale.size == 1:
            self.scale, self.block = scale.reshape(1, 1), (rows, cols)
        elif block is not None and scale.shape == (*lead, -(-rows // block[0]), -(-cols // block[1])):
            self.scale, self.block = scale, tuple(block)
        elif scale.shape in ((*lead, rows, 1), (*lead, rows)):
            self.scale, self.block = scale.reshape(*lead, rows, 1), (1, cols)
        else:
            expect = "a scale a row [out, 1] or one a tensor [1]" if block is None else \
                f"[{-(-rows // block[0])}, {-(-cols // block[1])}] (blocks of {block[0]} x {block[1]})"
            raise CheckpointError(f"{origin}: {name} {list(self.shape)} has scales of shape {list(scale.shape)}, "
                                  f"expected {expect}")

    def read(self, index: tuple, dtype: np.dtype) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(self.shape) - len(tuple(index)))
        values = take(self.tensor, index, np.dtype(np.float32))
        rows = np.arange(self.shape[-2])[index[-2]] // self.block[0]
        cols = np.arange(self.shape[-1])[index[-1]] // self.block[1]
        scale = self.scale
        if scale.ndim > 2:  # a stack of matrices: their own scales
            scale = scale[index[:-2]]
        scale = scale[..., rows[:, None] if self.scale.shape[-2] > 1 else [[0]],
                      cols[None, :] if self.scale.shape[-1] > 1 else [[0]]]
        return (values * scale).astype(dtype)


def fp8_tensors(tensors: Iterable[tuple[str, object, str]],
                block: tuple[int, int] | None) -> Iterator[tuple[str, object, str]]:
    """(name, tensor, origin) with every float8 weight as an Fp8View of itself and its scales (see the module
    doc); block: the checkpoint's weight_block_size, None where it has none. Other tensors pass as they are."""
    weights: dict[str, tuple[object, str]] = {}
    scales: dict[str, tuple[object, str, str]] = {}

    def view(base: str) -> tuple[str, object, str]:
        (tensor, origin), (scale, _, scale_name) = weights.pop(base), scales.pop(base)
        if np.dtype(scale.dtype).kind != "f":  # e.g. MXFP8's ue8m0 exponents stored as uint8
            raise CheckpointError(f"{origin}: {scale_name} is {np.dtype(scale.dtype)}; jserve reads float scales")
        return base + ".weight", Fp8View(tensor, take(scale, (), np.dtype(np.float32)), block, base + ".weight",
                                         origin), origin

    for name, tensor, origin in tensors:
        if name.endswith(ACTIVATION_SUFFIXES):
            continue
        suffix = next((s for s in SCALE_SUFFIXES if name.endswith(s)), None)
        if suffix is not None:
            base = name[:-len(suffix)]
            scales[base] = (tensor, origin, name)
        elif name.endswith(".weight") and np.dtype(getattr(tensor, "dtype", np.float32)) == FP8:
            base = name[:-len(".weight")]
            weights[base] = (tensor, origin)
        else:
            yield name, tensor, origin
            continue
        if base in weights and base in scales:
            yield view(base)
    for base, (_, origin) in weights.items():
        raise CheckpointError(f"{origin}: {base}.weight is float8 without scales ({base}.weight_scale_inv or "
                              f"{base}.weight_scale)")
    for base, (_, origin, name) in scales.items():
        raise CheckpointError(f"{origin}: {name} scales no float8 weight ({base}.weight is missing or not float8)")
