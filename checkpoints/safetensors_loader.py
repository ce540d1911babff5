"""Load Hugging Face safetensors checkpoints tensor by tensor into a Llama-family model's state.

The file format is read directly (8-byte header length, JSON header, raw little-endian data) through a memory
map, so a tensor is only copied when it is converted and placed; no framework is needed to read it. The model's
shape comes in as any object with CheckpointShape's fields (jserve's ModelConfig has them all).

assemble_state places tensors of any origin under Hugging Face names: the GGUF loader (checkpoints.gguf_reader
for the file, jserve.gguf_loading for the names) hands it lazily dequantized tensors, which ParamSource reads
through their own `read` (LazyTensor).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Protocol

import ml_dtypes
import numpy as np

from checkpoints import CheckpointError
from checkpoints.deepseek import deepseek_tensors
from checkpoints.gpt_oss import gpt_oss_tensors
from checkpoints.granite_moe import granite_moe_tensors
from checkpoints.llama4 import llama4_tensors
from checkpoints.tensor_views import llama_layout, take

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,  # FP8 checkpoints (checkpoints.fp8)
}

# A destination for one checkpoint tensor: the model-state path, and which part of a fused weight it is
# ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), or None when the tensor fills the parameter whole.
Target = tuple[tuple, str | None]

# The parts of each fused weight, in row order within one shard's block.
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class LazyTensor(Protocol):
    """A checkpoint tensor decoded only block by block (a GGUF tensor): `read(index, dtype)` returns the block an
    index tuple selects (its first entry a slice or an array of rows, the rest slices) as a new array of dtype."""

    @property
    def shape(self) -> tuple[int, ...]: ...
    def read(self, index: tuple, dtype: np.dtype) -> np.ndarray: ...


Tensor = np.ndarray | LazyTensor  # what a checkpoint tensor may be


class CheckpointShape(Protocol):
    """What the loader reads of the model's configuration: error messages name model_type and num_layers, the
    rest places tensors (fused_shards and kv_head_replicas: the tensor-parallel layout, 1 and 1 without it)."""

    @property
    def model_type(self) -> str: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def tie_word_embeddings(self) -> bool: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def q_size(self) -> int: ...  # query heads x head_dim
    @property
    def kv_size(self) -> int: ...  # KV heads (with their replicas) x head_dim
    @property
    def intermediate_size(self) -> int: ...
    @property
    def fused_shards(self) -> int: ...
    @property
    def kv_head_replicas(self) -> int: ...
    # Optional (checkpoints.tensor_views): rotary_dims (partial rotary embedding; head_dim without it),
    # rope_attention_factor (longrope, YaRN; 1.0), qk_norm and qk_norm_across_heads (False), residual_multiplier and
    # logits_scaling (Granite; 1.0),
    # norm_weight_offset (Gemma; 0.0).


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: one file, or the shards its index names."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index} names shard {f.name}, which does not exist")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json found "
                          "(only safetensors checkpoints are supported)")


def iter_tensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, array) for each tensor in one safetensors file, memory-mapped, in file order."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path}: truncated safetensors file")
        (header_len,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: bad safetensors header ({e})") from None
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        if end > data.size:
            raise CheckpointError(f"{path}: tensor {name} runs past the end of the file (truncated?)")
        shape = info["shape"]
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if not 0 <= start <= end or end - start != size:
            # as the safetensors library refuses it; else numpy's view or reshape fails naming neither
            raise CheckpointError(f"{path}: tensor {name} holds bytes {start}..{end} ({end - start} bytes), but "
                                  f"{info['dtype']} {list(shape)} takes {size} (a damaged header?)")
        yield name, data[start:end].view(dtype).reshape(shape)


def llama_name_map(tie_word_embeddings: bool, skip_layers_from: int | None = None,
                   latent_attention: bool = False) -> Callable[[str], list[Target] | None]:
    """Map a Hugging Face Llama-family tensor name to where it lands in LlamaForCausalLM's state; layers from
    skip_layers_from on are read as nothing (None: every layer is the decoder's). With latent_attention
    (DeepSeek) q_proj is a projection of its own, not a part of q|k|v."""
    fused = {part: dest for dest, parts in FUSED_PARTS.items() for part in parts
             if not (latent_attention and dest == "qkv_proj")}
    layer_re = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")
    norm_re = re.compile(r"model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm|pre_feedforward_layernorm|"
                         r"post_feedforward_layernorm)\.weight$")
    qk_norm_re = re.compile(r"model\.layers\.(\d+)\.self_attn\.(q_norm|k_norm)\.weight$")
    # Mixture of experts: each expert's matrix is one slice of a stacked [experts, out, in] parameter (or, from a
    # GGUF file, the whole stack at once); Qwen2-MoE's shared expert is a fused MLP of its own.
    expert_re = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(?:(\d+)\.)?(gate_proj|up_proj|down_proj)\."
                           r"(weight|bias)$")
    shared_re = re.compile(r"model\.layers\.(\d+)\.mlp\.shared_experts?\.(gate_proj|up_proj|down_proj)\.weight$")
    # gpt-oss's attention sinks (a GGUF file's attn_sinks.weight, read under the same name plus .weight)
    sinks_re = re.compile(r"model\.layers\.(\d+)\.self_attn\.sinks(\.weight)?$")
    correction_re = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias$")
    layer_index_re = re.compile(r"model\.layers\.(\d+)\.")

    def target(name: str) -> list[Target] | None:
        name = mixtral_name(name)
        if skip_layers_from is not None and (m := layer_index_re.match(name)) and int(m[1]) >= skip_layers_from:
            return []  # GLM-4.5's multi-token-prediction layers, past the decoder's (transformers skips them too)
        if m := correction_re.match(name):
            return [(("layers", int(m[1]), "mlp", "gate", "e_score_correction_bias"), None)]
        if m := expert_re.match(name):
            return [(("layers", int(m[1]), "mlp", "experts", m[3], m[4]), None if m[2] is None else int(m[2]))]
        if m := shared_re.match(name):
            proj = m[2]
            dest = fused.get(proj, proj)
            return [(("layers", int(m[1]), "mlp", "shared_expert", dest, "weight"), proj if proj in fused else None)]
        if name == "model.embed_tokens.weight":
            return [(("embed_tokens",), None)]
        if name == "model.norm.weight":
            return [(("norm", "weight"), None)]
        if name == "lm_head.weight":
            return [] if tie_word_embeddings else [(("lm_head",), None)]  # tied: a copy of embed
        if name.endswith("rotary_emb.inv_freq"):
            return []  # old checkpoints store the rotary table; we compute it
        if m := norm_re.match(name):
            return [(("layers", int(m[1]), m[2], "weight"), None)]
        if m := sinks_re.match(name):
            return [(("layers", int(m[1]), "self_attn", "sinks"), None)]
        if m := qk_norm_re.match(name):
            return [(("layers", int(m[1]), "self_attn", m[2], "weight"), None)]
        if m := layer_re.match(name):
            layer, block, proj, kind = int(m[1]), m[2], m[3], m[4]
            if proj in fused:
                return [(("layers", layer, block, fused[proj], kind), proj)]
            return [(("layers", layer, block, proj, kind), None)]
        return None

    return target


_MIXTRAL_EXPERT = re.compile(r"(model\.layers\.\d+\.)block_sparse_moe\.(?:(experts\.\d+\.)(w[123])|(gate))\.weight$")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def mixtral_name(name: str) -> str:
    """A Mixtral tensor's name as Qwen-MoE's (block_sparse_moe.experts.J.w1 -> mlp.experts.J.gate_proj; w2 is down,
    w3 up), which the name map places."""
    m = _MIXTRAL_EXPERT.match(name)
    if m is None:
        return name
    if m[4]:
        return f"{m[1]}mlp.gate.weight"
    return f"{m[1]}mlp.{m[2]}{_MIXTRAL_PROJ[m[3]]}.weight"


class ParamSource:
    """Where one model parameter's values are in the memory-mapped checkpoint, and how to read any slice of it.

    `read(index)` returns just the requested block (a shard) as a fresh array of the parameter's dtype, so a
    sharded parameter is never assembled whole on the host (the loader's place_sharded reads one device's
    block at a time). Fused parameters gather their rows from several checkpoint tensors through a row map.
    """

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.whole: Tensor | None = None
        self.parts: dict[str, Tensor] = {}  # fused part name -> checkpoint tensor (memory-mapped or lazy)
        self.row_map: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # see fused_row_map
        self.experts: dict[int, Tensor] = {}  # a stacked experts' parameter: expert index -> its [out, in] tensor

    def read(self, index: tuple = ()) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(self.shape) - len(tuple(index)))
        if self.whole is not None:
            return take(self.whole, index, self.dtype)
        if self.experts:
            return np.stack([take(self.experts[e], index[1:], self.dtype)
                             for e in range(*index[0].indices(self.shape[0]))])
        start, stop, step = index[0].indices(self.shape[0])
        assert step == 1, index  # shards are contiguous blocks
        rest = index[1:]
        out = np.empty((stop - start, *(len(range(*s.indices(n))) for s, n in zip(rest, self.shape[1:], strict=True))),
                       self.dtype)
        for name, (dest, src) in self.row_map.items():
            keep = (dest >= start) & (dest < stop)
            if keep.any():
                out[dest[keep] - start] = take(self.parts[name], (src[keep], *rest), self.dtype)
        return out


def fused_row_map(config: CheckpointShape, dest: str, rows: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """For each part of a fused weight of `rows` rows: (destination rows in the fused parameter, source rows in its
    tensor). gate|up's halves are as wide as the MLP's (a shared expert's own width where it differs).

    The fused rows are config.fused_shards blocks; block i holds part after part, each part's i-th slice of
    rows, so a row split into fused_shards equal pieces gives each device its own heads (see
    sharding.kv_head_replicas). Each checkpoint KV head is repeated config.kv_head_replicas times.
    """
    shards, d, reps = config.fused_shards, config.head_dim, config.kv_head_replicas
    kv_src = (np.arange(config.kv_size) // d // reps) * d + np.arange(config.kv_size) % d
    sources = {"q_proj": np.arange(config.q_size), "k_proj": kv_src, "v_proj": kv_src,
               "gate_proj": np.arange(rows // 2), "up_proj": np.arange(rows // 2)}
    parts = FUSED_PARTS[dest]
    block = sum(len(sources[p]) for p in parts) // shards
    row_map, offset = {}, 0
    for part in parts:
        src = sources[part]
        per_shard = len(src) // shards
        rows = np.arange(len(src))
        row_map[part] = ((rows // per_shard) * block + offset + rows % per_shard, src)
        offset += per_shard
    return row_map


def load_state(model_dir: str | Path, config: CheckpointShape,
               shapes: dict[tuple, tuple[tuple[int, ...], np.dtype]],
               place: Callable[[tuple, ParamSource], object],
               transform: Callable[[Iterable], Iterator] | None = None) -> dict[tuple, object]:
    """Fill every parameter of `shapes` ({path: (shape, dtype)}) from the checkpoint directory's safetensors;
    transform: what (name, tensor, origin) of the files pass through first (an FP8 checkpoint's checkpoints.fp8).

    First every tensor is located (headers only; the data stay memory-mapped), then each parameter is handed to
    `place` (which builds the device or mesh array from `source.read`) one at a time, so host memory holds at
    most one parameter's shards in flight beyond the memory-mapped files.
    Missing, unexpected and mis-shaped tensors raise CheckpointError naming the tensor and file.
    """
    tensors = ((name, tensor, str(file)) for file in checkpoint_files(model_dir) for name, tensor in iter_tensors(file))
    if transform is not None:
        tensors = transform(tensors)
    return assemble_state(language_model_tensors(tensors), config, shapes, place, str(model_dir))


# An image-text checkpoint (Gemma 3's Gemma3ForConditionalGeneration) holds its language model under a prefix:
# "language_model.model." as published, "model.language_model." as transformers >= 5 saves it.
# A base model saved without its head (transformers' AutoModel: Qwen3-Embedding) names its tensors without "model.".
_LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                            ("language_model.lm_head.", "lm_head."), ("layers.", "model.layers."),
                            ("embed_tokens.", "model.embed_tokens."), ("norm.", "model.norm."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
                    "vision_model.", "model.vision_model.")  # Llama 4's


def language_model_tensors(tensors: Iterable[tuple[str, Tensor, str]]) -> Iterator[tuple[str, Tensor, str]]:
    """The tensors of a checkpoint's language model under the plain causal-LM names; an image-text checkpoint's
    vision tower and projector are left out (jserve serves text)."""
    for name, tensor, origin in tensors:
        if name.startswith(_VISION_PREFIXES):
            continue
        for prefix, plain in _LANGUAGE_MODEL_PREFIXES:
            if name.startswith(prefix):
                name = plain + name[len(prefix):]
                break
        yield name, tensor, origin


def assemble_state(tensors: Iterable[tuple[str, Tensor, str]], config: CheckpointShape,
                   shapes: dict[tuple, tuple[tuple[int, ...], np.dtype]],
                   place: Callable[[tuple, ParamSource], object], where: str,
                   describe: Callable[[tuple], str] | None = None) -> dict[tuple, object]:
    """load_state for tensors of any origin: (Hugging Face name, tensor, where it is for error messages) for each
    tensor of the checkpoint `where`; `describe` names the tensor(s) a parameter missing from it would come from
    (default: their Hugging Face names)."""
    # GLM-4.5 and DeepSeek-V3 checkpoints hold num_nextn_predict_layers multi-token-prediction layers after the
    # decoder's
    name_map = llama_name_map(config.tie_word_embeddings,
                              config.num_layers if config.model_type in ("glm4_moe", "deepseek_v3") else None,
                              bool(getattr(config, "kv_lora_rank", 0)))
    sources: dict[tuple, ParamSource] = {}
    if config.model_type == "gpt_oss":  # its router and experts under the other mixtures of experts' names
        tensors = gpt_oss_tensors(tensors)
    if config.model_type in ("granitemoe", "granitemoeshared"):  # the same for Granite's stacked experts
        tensors = granite_moe_tensors(tensors)
    if config.model_type == "llama4_text":  # and for Llama 4's feed_forward
        tensors = llama4_tensors(tensors)
    if getattr(config, "kv_lora_rank", 0):  # DeepSeek's latent attention: its rotary rows as the model pairs them
        tensors = deepseek_tensors(tensors, config)
    for name, tensor, origin in llama_layout(tensors, config):
        targets = name_map(name)
        if targets is None:
            raise CheckpointError(f"{origin}: unexpected tensor {name} for a {config.model_type} model")
        for path, part in targets:
            if path not in shapes:
                param = ".".join(map(str, path))
                raise CheckpointError(f"{origin}: unexpected tensor {name} (no parameter {param} "
                                      f"in a {config.num_layers}-layer {config.model_type} model)")
            shape, dtype = shapes[path]
            source = sources.setdefault(path, ParamSource(shape, dtype))
            if part is None:
                _check_shape(tensor.shape, shape, name, origin)
                source.whole = tensor
            elif isinstance(part, int):  # one expert of a stacked parameter
                if part >= shape[0]:
                    raise CheckpointError(f"{origin}: unexpected tensor {name} (the model has {shape[0]} experts)")
                _check_shape(tensor.shape, shape[1:], name, origin)
                source.experts[part] = tensor
            else:
                _check_shape(tensor.shape, (_fused_rows(name, config, shape[0]), *shape[1:]), name, origin)
                source.parts[part] = tensor
    complete = {path for path, src in sources.items()
                if src.whole is not None or (len(src.experts) == src.shape[0] if src.experts
                                             else len(src.parts) == len(FUSED_PARTS[path[-2]]))}
    missing = [p for p in shapes if p not in complete]
    if missing:
        names = ", ".join((describe or hf_names)(p) for p in missing[:8])
        raise CheckpointError(f"{where}: checkpoint is missing tensor(s) {names}"
                              + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    placed: dict[tuple, object] = {}
    for path in shapes:
        source = sources.pop(path)  # drop our reference once placed
        if source.whole is None and not source.experts:
            source.row_map = fused_row_map(config, path[-2], source.shape[0])
        placed[path] = place(path, source)
    return placed


def _fused_rows(name: str, config: CheckpointShape, fused_rows: int) -> int:
    """Rows of one checkpoint tensor of a fused weight of fused_rows rows (before any KV-head replication)."""
    proj = name.rsplit(".", 2)[-2]
    kv_rows = config.kv_size // config.kv_head_replicas
    return {"q_proj": config.q_size, "k_proj": kv_rows, "v_proj": kv_rows,
            "gate_proj": fused_rows // 2, "up_proj": fused_rows // 2}[proj]


def _check_shape(got: tuple, expected: tuple, name: str, origin: str) -> None:
    if tuple(got) != tuple(expected):
        raise CheckpointError(f"{origin}: tensor {name} has shape {list(got)}, expected {list(expected)} "
                              "from the model's configuration")


def hf_names(path: tuple) -> str:
    """The Hugging Face tensor name(s) that fill a model-state path ("/"-separated), for error messages."""
    if path == ("embed_tokens",):
        return "model.embed_tokens.weight"
    if path == ("lm_head",):
        return "lm_head.weight"
    if path[0] != "layers":
        return "model." + ".".join(map(str, path))
    prefix = "model.layers." + ".".join(map(str, path[1:-2])) + "."
    if path[-2] == "qkv_proj":
        return "/".join(f"{prefix}{p}.{path[-1]}" for p in ("q_proj", "k_proj", "v_proj"))
    if path[-2] == "gate_up_proj":
        return "/".join(f"{prefix}{p}.{path[-1]}" for p in ("gate_proj", "up_proj"))
    if path[-3] == "experts":
        return f"{prefix}N.{path[-2]}.{path[-1]} (N: each expert)"
    return prefix + ".".join(map(str, path[-2:]))
