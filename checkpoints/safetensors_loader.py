"""Load Hugging Face safetensors checkpoints tensor by tensor into a jserve model's state.

The file format is read directly (8-byte header length, JSON header, raw little-endian data) through a memory
map, so a tensor is only copied when it is converted and placed; no framework is needed to read it.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from jserve.config import ModelConfig, ModelLoadError

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}

# A destination for one checkpoint tensor: the model-state path, and the row offset inside a fused weight
# (q/k/v and gate/up are concatenated along their output axis), or None when the tensor fills it whole.
Target = tuple[tuple, int | None]


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: one file, or the shards its index names."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from None
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{index} names shard {f.name}, which does not exist")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelLoadError(f"{model_dir}: no model.safetensors or model.safetensors.index.json found "
                         "(only safetensors checkpoints are supported)")


def iter_tensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, array) for each tensor in one safetensors file, memory-mapped, in file order."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ModelLoadError(f"{path}: truncated safetensors file")
        (header_len,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{path}: bad safetensors header ({e})") from None
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ModelLoadError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        if end > data.size:
            raise ModelLoadError(f"{path}: tensor {name} runs past the end of the file (truncated?)")
        yield name, data[start:end].view(dtype).reshape(info["shape"])


def llama_name_map(config: ModelConfig) -> Callable[[str], list[Target] | None]:
    """Map a Hugging Face Llama-family tensor name to where it lands in LlamaForCausalLM's state."""
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", q), "v_proj": ("qkv_proj", q + kv),
             "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", inter)}
    layer_re = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")
    norm_re = re.compile(r"model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight$")
    qk_norm_re = re.compile(r"model\.layers\.(\d+)\.self_attn\.(q_norm|k_norm)\.weight$")

    def target(name: str) -> list[Target] | None:
        if name == "model.embed_tokens.weight":
            return [(("embed_tokens",), None)]
        if name == "model.norm.weight":
            return [(("norm", "weight"), None)]
        if name == "lm_head.weight":
            return [] if config.tie_word_embeddings else [(("lm_head",), None)]  # tied: a copy of embed
        if name.endswith("rotary_emb.inv_freq"):
            return []  # old checkpoints store the rotary table; we compute it
        if m := norm_re.match(name):
            return [(("layers", int(m[1]), m[2], "weight"), None)]
        if m := qk_norm_re.match(name):
            return [(("layers", int(m[1]), "self_attn", m[2], "weight"), None)]
        if m := layer_re.match(name):
            layer, block, proj, kind = int(m[1]), m[2], m[3], m[4]
            if proj in fused:
                dest, offset = fused[proj]
                return [(("layers", layer, block, dest, kind), offset)]
            return [(("layers", layer, block, proj, kind), None)]
        return None

    return target


def load_state(model_dir: str | Path, config: ModelConfig, shapes: dict[tuple, tuple[tuple[int, ...], np.dtype]],
               place: Callable[[tuple, np.ndarray], object]) -> dict[tuple, object]:
    """Fill every parameter of `shapes` ({path: (shape, dtype)}) from the checkpoint.

    Each finished parameter is handed to `place` (which puts it on the device or mesh) as soon as it is
    complete, so host memory holds at most one fused parameter in flight beyond the memory-mapped files.
    Missing, unexpected and mis-shaped tensors raise ModelLoadError naming the tensor and file.
    """
    name_map = llama_name_map(config)
    pending: dict[tuple, np.ndarray] = {}
    rows_filled: dict[tuple, int] = {}
    placed: dict[tuple, object] = {}
    for file in checkpoint_files(model_dir):
        for name, tensor in iter_tensors(file):
            targets = name_map(name)
            if targets is None:
                raise ModelLoadError(f"{file}: unexpected tensor {name} for a {config.model_type} model")
            for path, offset in targets:
                if path not in shapes:
                    raise ModelLoadError(f"{file}: unexpected tensor {name} (no parameter {'.'.join(map(str, path))} "
                                         f"in a {config.num_layers}-layer {config.model_type} model)")
                shape, dtype = shapes[path]
                if offset is None:
                    _check_shape(tensor.shape, shape, name, file)
                    placed[path] = place(path, np.asarray(tensor, dtype=dtype))
                    continue
                expected = (_fused_rows(name, config), *shape[1:])
                _check_shape(tensor.shape, expected, name, file)
                buf = pending.setdefault(path, np.zeros(shape, dtype))
                buf[offset: offset + tensor.shape[0]] = tensor
                rows_filled[path] = rows_filled.get(path, 0) + tensor.shape[0]
                if rows_filled[path] == shape[0]:
                    placed[path] = place(path, pending.pop(path))
    missing = [p for p in shapes if p not in placed]
    if missing:
        names = ", ".join(_hf_names(p, config) for p in missing[:8])
        raise ModelLoadError(f"{model_dir}: checkpoint is missing tensor(s) {names}"
                             + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    return placed


def _fused_rows(name: str, config: ModelConfig) -> int:
    proj = name.rsplit(".", 2)[-2]
    return {"q_proj": config.q_size, "k_proj": config.kv_size, "v_proj": config.kv_size,
            "gate_proj": config.intermediate_size, "up_proj": config.intermediate_size}[proj]


def _check_shape(got: tuple, expected: tuple, name: str, file: Path) -> None:
    if tuple(got) != tuple(expected):
        raise ModelLoadError(f"{file}: tensor {name} has shape {list(got)}, expected {list(expected)} "
                             "from config.json")


def _hf_names(path: tuple, config: ModelConfig) -> str:
    """The checkpoint tensor name(s) that fill a model-state path, for error messages."""
    if path == ("embed_tokens",):
        return "model.embed_tokens.weight"
    if path == ("lm_head",):
        return "lm_head.weight"
    if path[0] != "layers":
        return "model." + ".".join(map(str, path))
    prefix = f"model.layers.{path[1]}.{path[2]}."
    rest = ".".join(map(str, path[3:]))
    if path[3] == "qkv_proj":
        return "/".join(f"{prefix}{p}.{path[4]}" for p in ("q_proj", "k_proj", "v_proj"))
    if path[3] == "gate_up_proj":
        return "/".join(f"{prefix}{p}.{path[4]}" for p in ("gate_proj", "up_proj"))
    return prefix + rest
