"""Read GGUF files (what llama.cpp and Ollama keep on disk): metadata, and tensors dequantized block by block.

gguf.GGUFReader memory-maps the file and parses its metadata and tensor index; a tensor's bytes stay in the map
until a GGUFTensor reads a block of its rows, which it dequantizes with gguf.dequantize (F32, F16, BF16, Q4_0 to
Q8_0, the k-quants, the IQ and ternary types) a bounded number of rows at a time, straight into the dtype asked
for. So a parameter, or one device's shard of it, is decoded without first decoding its whole tensor, and the
safetensors loader's placement (safetensors_loader.ParamSource, through LazyTensor) reads GGUF tensors as it reads
memory-mapped safetensors.

Shapes are Hugging Face's: GGUF lists a tensor's dimensions innermost first, and GGUFReader's arrays already have
them reversed ([out, in] for a projection), with each row's quantized blocks along the last axis.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import numpy as np

try:
    import gguf
except ImportError:  # a GGUF file then gets a clear error; safetensors checkpoints load without the package
    gguf = None

from checkpoints import CheckpointError

# Decoded float32 values one read holds beyond its result: with 4096 columns, 1024 rows (16 MiB) at a time.
_CHUNK_ELEMENTS = 1 << 22


@functools.cache
def dequantizable(qtype: gguf.GGMLQuantizationType) -> bool:
    """Whether gguf.dequantize decodes this tensor type (it raises NotImplementedError for the rest: Q8_1, Q8_K, the
    integer types), found by decoding one block of zeros so that a newer gguf's new types count too."""
    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return True
    if qtype not in gguf.GGML_QUANT_SIZES:
        return False
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        out = gguf.dequantize(np.zeros((1, type_size), np.uint8), qtype)
    except NotImplementedError:
        return False
    return out.dtype == np.float32 and out.size == block


class GGUFTensor:
    """One GGUF tensor as an array whose blocks are decoded on demand (checkpoints.safetensors_loader.LazyTensor).

    row_order: for a tensor stored with its rows permuted (llama.cpp's q/k projections, see jserve.gguf_loading),
    the stored row that holds each of its rows; None: stored in order.
    """

    def __init__(self, name: str, data: np.ndarray, qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...],
                 row_order: np.ndarray | None = None):
        self.name, self.data, self.qtype, self.shape = name, data, qtype, tuple(shape)
        self.row_order = row_order

    @property
    def type_name(self) -> str:
        return self.qtype.name

    def with_row_order(self, row_order: np.ndarray) -> GGUFTensor:
        if len(row_order) != self.shape[0]:
            raise ValueError(f"{self.name}: a row order of {len(row_order)} rows for {self.shape[0]}")
        return GGUFTensor(self.name, self.data, self.qtype, self.shape, np.asarray(row_order, np.int64))

    def read(self, index: tuple = (), dtype: np.dtype | type = np.float32) -> np.ndarray:
        """The block `index` selects (its first entry a slice or an integer array of rows, the rest slices), decoded
        into a new array of dtype."""
        index = tuple(index) + (slice(None),) * (len(self.shape) - len(tuple(index)))
        rows = np.arange(self.shape[0])[index[0]]
        if self.row_order is not None:
            rows = self.row_order[rows]
        if len(self.shape) == 1:  # a norm or a bias: small, decoded whole
            return self._decode(slice(None))[rows].astype(dtype)
        if len(self.shape) != 2:
            raise CheckpointError(f"tensor {self.name}: {len(self.shape)}-dimensional tensors are not supported")
        columns, stored = index[1], slice(None)
        start, stop, step = columns.indices(self.shape[1])
        block, type_size = gguf.GGML_QUANT_SIZES[self.qtype]
        if step == 1 and start % block == 0 and (stop % block == 0 or stop == self.shape[1]):
            # A column shard (tensor parallelism splits o_proj and down_proj by input) whose edges fall between
            # quantization blocks: decode only its blocks. Quantized rows are bytes, F32 and F16 rows values.
            per = type_size if self.data.dtype == np.uint8 else block
            stored, columns = slice(start // block * per, -(-stop // block) * per), slice(None)
        width = len(range(start, stop, step))
        out = np.empty((len(rows), width), dtype)
        chunk_rows = max(1, _CHUNK_ELEMENTS // max(1, self.shape[1]))
        for first in range(0, len(rows), chunk_rows):
            chunk = rows[first:first + chunk_rows]
            # Consecutive rows (a whole tensor, a row shard) are a view of the map; others are gathered first.
            contiguous = int(chunk[-1]) - int(chunk[0]) + 1 == len(chunk) and bool(np.all(np.diff(chunk) == 1))
            picked = slice(int(chunk[0]), int(chunk[-1]) + 1) if contiguous else chunk
            out[first:first + len(chunk)] = self._decode((picked, stored))[:, columns]
        return out

    def _decode(self, index: slice | np.ndarray | tuple) -> np.ndarray:
        return np.asarray(gguf.dequantize(self.data[index], self.qtype), np.float32)


class GGUFFile:
    """A GGUF file's metadata (`get`) and tensors (`tensors`, by name, in file order).

    Metadata arrays longer than MAX_KEPT_ARRAY are kept as Python lists only for the tokenizer's keys (the
    vocabulary, its merges, scores and token types, which jserve.gguf_tokenizer builds the tokenizer from); GGUFReader
    holds each entry as a numpy view. `array_lengths` has the lengths of every long array.
    """

    MAX_KEPT_ARRAY = 4096

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if gguf is None:
            raise CheckpointError(f"{self.path}: reading a GGUF file needs the gguf package (pip install gguf)")
        try:
            reader = gguf.GGUFReader(self.path)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read ({e})") from None
        except Exception as e:  # gguf raises ValueError, IndexError, ... on a file that is not GGUF or is cut short
            raise CheckpointError(f"{self.path}: not a valid GGUF file ({type(e).__name__}: {e})") from None
        self.metadata: dict[str, Any] = {}
        self.array_lengths: dict[str, int] = {}
        for key, field in reader.fields.items():
            if field.types and field.types[0] == gguf.GGUFValueType.ARRAY and len(field.data) > self.MAX_KEPT_ARRAY:
                self.array_lengths[key] = len(field.data)
                if key.startswith("tokenizer.ggml."):  # the vocabulary: what a tokenizer is built from
                    self.metadata[key] = _array_contents(field)
            else:
                self.metadata[key] = field.contents()
        self.tensors: dict[str, GGUFTensor] = {
            t.name: GGUFTensor(t.name, t.data, t.tensor_type, tuple(int(d) for d in reversed(t.shape.tolist())))
            for t in reader.tensors}

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value (a number, a string, or a list of them), or default where the file has no such key."""
        return self.metadata.get(key, default)

    def __contains__(self, key: str) -> bool:
        return key in self.metadata or key in self.array_lengths

    @property
    def architecture(self) -> str | None:
        return self.get("general.architecture")

    def check_tensor_types(self) -> None:
        """Raise CheckpointError naming the first tensor whose type gguf cannot dequantize."""
        for tensor in self.tensors.values():
            if not dequantizable(tensor.qtype):
                supported = sorted(t.name for t in gguf.GGMLQuantizationType if dequantizable(t))
                raise CheckpointError(f"{self.path}: tensor {tensor.name} is stored as {tensor.type_name}, which "
                                      f"cannot be dequantized (supported: {', '.join(supported)})")


def _array_contents(field: Any) -> list:
    """A long metadata array as Python values, decoded in one pass (field.contents() takes ~20x as long on a 49K
    vocabulary: it builds each element through the generic path)."""
    if field.types[-1] == gguf.GGUFValueType.STRING:
        return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
    return np.concatenate([field.parts[i] for i in field.data]).tolist()


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """The parsed file, shared by the reads of one load (its config, then its weights): GGUFReader parses every
    metadata entry, each vocabulary string on its own (~3 s for a 49K-token vocabulary). Keyed by the file's size and
    modification time, so a rewritten file is parsed afresh."""
    path = Path(path).resolve()
    try:
        stat = path.stat()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from None
    return _open_cached(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_cached(path: Path, size: int, mtime_ns: int) -> GGUFFile:
    del size, mtime_ns  # part of the cache key only
    return GGUFFile(path)
