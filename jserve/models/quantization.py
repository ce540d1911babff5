"""Weight-only quantization of the decoder layers' projection matrices (and, for int8, the LM head):
per-output-channel symmetric int8 (or float8_e4m3fn on GPU), one float32 scale per output row, activations left in
float (the C++ CPU kernels' compute-bound int8 steps quantize them: cpu_kernels/matmul_int8_vnni.h).

A quantized `Linear` holds `weight` in the quantized dtype ([out, in], the checkpoint layout) and `scale`
float32[out] with the weight's output logical axis, so under tensor parallelism each device's scales follow its
rows. The matmul (`quantized_matmul`) never builds a float copy of a weight: the dot reads the int8 operand
converted to the compute dtype, which GPU and TPU compilers fuse into the dot, and the scale multiplies the
[tokens, out] result. XLA CPU instead converts a dot's operand into a whole float buffer first, so there, for steps
of few tokens (decode), the product is written as a multiply-and-reduce that XLA fuses into one loop over the
int8 weight; longer steps (prefill) use the dot, where one matrix's conversion is amortised over many tokens.

int8 quantizes the LM head too, per vocabulary row (`head_scale`): in a tied model (the default SmolLM2) that is the
embedding table, which the lookup then dequantizes row by row. A batch-1 decode step reads the whole head, a fifth
of the default model's bf16 bytes; its int8 rounding moves the default model's perplexity by 0.04%. fp8 keeps the
head in `dtype` (e4m3 keeps 3 mantissa bits, and the head's accuracy there has not been measured). An untied
model's input embeddings stay in `dtype` (a lookup reads a few rows). Checkpoints quantized elsewhere
(compressed-tensors) keep the head they store.

Hand-written rather than qwix: qwix quantizes by intercepting the jnp / nnx ops of a model it re-traces (its
`QtRule` regexes match module paths), while our Linear calls lax.dot_general on Hugging Face's [out, in] layout
and our loader fills parameters shard by shard from memory-mapped checkpoints; quantizing at load into two
declared parameters keeps the sharding rules, the loader and the step's flat parameter list unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from checkpoints.safetensors_loader import CheckpointError, assemble_state, checkpoint_files, iter_tensors
from jserve.config import ModelLoadError

# Quantized storage dtype and the largest magnitude it holds, per scheme.
SCHEMES: dict[str, tuple[jnp.dtype, float]] = {
    "int8": (jnp.dtype(jnp.int8), 127.0),
    "fp8": (jnp.dtype(jnp.float8_e4m3fn), 448.0),
}
# Steps of at most this many tokens use the fused multiply-and-reduce on XLA CPU (see the module docstring).
CPU_REDUCE_MAX_TOKENS = 16


def quantize_rows(w: np.ndarray, scheme: str = "int8") -> tuple[np.ndarray, np.ndarray]:
    """w[..., out, in] (any float dtype) -> (quantized weight[..., out, in], float32 scale[..., out]) with
    w ~= q * scale[..., None] (a stack of experts' matrices is quantized matrix by matrix).

    Symmetric per output channel: scale = max|row| / qmax; an all-zero row gets scale 1 (q = 0 either way)."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization {scheme!r}; expected one of {tuple(SCHEMES)}")
    if w.ndim < 2:
        raise ValueError(f"quantize_rows: expected an [out, in] matrix, got shape {w.shape}")
    qdtype, qmax = SCHEMES[scheme]
    w32 = np.asarray(w, np.float32)
    amax = np.max(np.abs(w32), axis=-1)
    if not np.all(np.isfinite(amax)):
        raise ValueError("quantize_rows: the weight holds inf or NaN")
    scale = np.where(amax > 0, amax / qmax, 1.0).astype(np.float32)
    scaled = w32 / scale[..., None]
    if qdtype == jnp.int8:
        return np.clip(np.rint(scaled), -qmax, qmax).astype(np.int8), scale
    return np.asarray(jnp.asarray(np.clip(scaled, -qmax, qmax)).astype(qdtype)), scale


def quantize_rows_on_device(w: jax.Array, scheme: str, shardings: tuple[jax.sharding.Sharding, jax.sharding.Sharding]
                            | None = None) -> tuple[jax.Array, jax.Array]:
    """quantize_rows() of a weight where it lives (a dummy weight drawn on its devices never crosses the host),
    the results placed by shardings (weight's, scale's; None: the default device)."""
    return _device_quantizer(scheme, shardings)(w)


@functools.cache
def _device_quantizer(scheme: str, shardings: tuple | None) -> Callable:
    qdtype, qmax = SCHEMES[scheme]

    def quantize(w: jax.Array) -> tuple[jax.Array, jax.Array]:
        w32 = w.astype(jnp.float32)
        amax = jnp.max(jnp.abs(w32), axis=-1)
        scale = jnp.where(amax > 0, amax / qmax, 1.0).astype(jnp.float32)
        scaled = w32 / scale[..., None]
        q = jnp.clip(jnp.rint(scaled), -qmax, qmax) if qdtype == jnp.int8 else jnp.clip(scaled, -qmax, qmax)
        return q.astype(qdtype), scale

    return jax.jit(quantize) if shardings is None else jax.jit(quantize, out_shardings=shardings)


def dequantize_rows(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The float32 matrix a quantized weight stands for."""
    return np.asarray(q, np.float32) * np.asarray(scale, np.float32)[..., None]


def quantized_matmul(x: jax.Array, w: jax.Array, scale: jax.Array, compute_dtype: jnp.dtype) -> jax.Array:
    """x[..., in] @ dequantize(w[out, in], scale)^T -> float32[..., out], without a float copy of w."""
    xc = x.astype(compute_dtype)
    tokens = int(np.prod(x.shape[:-1], dtype=np.int64))
    if jax.default_backend() == "cpu" and tokens <= CPU_REDUCE_MAX_TOKENS:
        # A loop fusion: each int8 element is converted in registers, multiplied and summed; nothing weight-sized.
        prod = xc.astype(jnp.float32)[..., None, :] * w.astype(compute_dtype).astype(jnp.float32)
        y = jnp.sum(prod, axis=-1)
    else:
        y = jax.lax.dot_general(xc, w.astype(compute_dtype), (((x.ndim - 1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
    return y * scale


HEAD_PATHS = (("embed_tokens",), ("lm_head",))  # the LM head's weight: the tied embedding table, or its own
HEAD_SCALE_PATH = ("head_scale",)


def quantizes_head(scheme: str) -> bool:
    """Whether `--quantization scheme` quantizes the LM head too (see the module docstring)."""
    return scheme == "int8"


def quantize_model(model: nnx.Module, scheme: str, head: bool | None = None) -> list[tuple]:
    """Turn every Linear of the decoder layers of an (abstract) model into a quantized one, in place: `weight`
    becomes the scheme's dtype, `scale` float32[out] is added; with `head` (default: quantizes_head(scheme)) the LM
    head's weight too, with the model's `head_scale` float32[vocab]. -> the state paths of the quantized weights."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization {scheme!r}; expected one of {tuple(SCHEMES)}")
    qdtype, _ = SCHEMES[scheme]
    paths = []
    if quantizes_head(scheme) if head is None else head:
        name = "embed_tokens" if model.lm_head is None else "lm_head"
        weight = getattr(model, name)
        axes = weight.get_metadata().get("logical_axes")
        model.head_compute_dtype = jnp.dtype(weight.dtype)
        setattr(model, name, nnx.Param(jnp.zeros(weight.shape, qdtype), logical_axes=axes))
        model.head_scale = nnx.Param(jnp.ones((weight.shape[0],), jnp.float32), logical_axes=axes[:1])
        paths.append((name,))
    for path, module in nnx.iter_graph(model):
        if not getattr(module, "quantizable", False) or not path or path[0] != "layers":
            continue
        weight = module.weight  # [out, in], or an ExpertLinear's [experts, out, in]
        axes = weight.get_metadata().get("logical_axes")
        module.compute_dtype = jnp.dtype(weight.dtype)
        module.weight = nnx.Param(jnp.zeros(weight.shape, qdtype), logical_axes=axes)
        module.scale = nnx.Param(jnp.ones(weight.shape[:-1], jnp.float32), logical_axes=axes[:-1])
        paths.append((*path, "weight"))
    return paths


def scale_path(weight_path: tuple) -> tuple:
    """Where a quantized weight's scales are: a Linear's `scale` beside its `weight`, or the LM head's head_scale."""
    return HEAD_SCALE_PATH if weight_path in HEAD_PATHS else (*weight_path[:-1], "scale")


def resident_bytes(state: nnx.State) -> int:
    """Bytes of every parameter of a model state (global sizes, as the checkpoint would hold them)."""
    return int(sum(leaf.size * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(state)
                   if hasattr(leaf, "dtype")))


# ----- pre-quantized Hugging Face checkpoints -----
#
# config.json's quantization_config {"quant_method": "compressed-tensors", "format": "int-quantized" |
# "pack-quantized", "config_groups": {name: {"weights": {"num_bits": 8, "type": "int", "symmetric": true,
# "strategy": "channel"}, "input_activations": null}}, "ignore": [...]}. A quantized Linear `X` is stored as
# `X.weight` (int8; int-quantized) or `X.weight_packed` (int32, four offset-by-128 bytes per word along the input
# axis, value j*4 + i in bits 8i..8i+7 of word j; pack-quantized) plus `X.weight_scale` ([out, 1]) and, for
# pack-quantized, `X.weight_shape` ([out, in]); the weight is q * scale.
#
# FP8 checkpoints (checkpoints.fp8): {"quant_method": "fp8", "weight_block_size": [bm, bn]} (Hugging Face's, as
# DeepSeek-V3 and Qwen3-*-FP8 publish them) or compressed-tensors' "float-quantized" format (weights num_bits 8, type
# float, strategy tensor, channel or block with its block_structure). Their weights are dequantized as they are read;
# activation quantization, where the checkpoint asks for it, is not applied (weight-only, as vLLM runs such
# checkpoints on GPUs without FP8 matmuls).

CT_FORMATS = ("int-quantized", "pack-quantized")
CT_FP8_FORMAT = "float-quantized"
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class StoredQuantization:
    """How a Hugging Face checkpoint's quantization_config says its weights are stored."""
    method: str  # "int8": compressed-tensors W8A16, read as stored | "fp8": float8 with scales, dequantized as read
    format: str = ""  # int8: "int-quantized" | "pack-quantized"
    block: tuple[int, int] | None = None  # fp8: one scale a block of [rows, columns]; None: a row's or a tensor's


def checkpoint_quantization(model_dir: str | Path) -> StoredQuantization | None:
    """How a checkpoint directory's weights are stored (see above); None for float weights or gpt-oss's MXFP4
    experts. ModelLoadError for any quantization jserve does not load."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    with open(path) as f:
        cfg = json.load(f)
    qc = cfg.get("quantization_config")
    if qc is None:
        return None
    where = f"{path}: quantization_config"
    method = qc.get("quant_method") if isinstance(qc, dict) else qc
    if method == "mxfp4" and cfg.get("model_type") == "gpt_oss":
        return None  # gpt-oss's MXFP4 experts are dequantized as they load (checkpoints.gpt_oss)
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ModelLoadError(f"{where}: fmt {qc.get('fmt')!r} is not supported (jserve reads e4m3 weights)")
        return StoredQuantization("fp8", block=_block(qc.get("weight_block_size"), f"{where}: weight_block_size"))
    if method != "compressed-tensors":
        raise ModelLoadError(f"{where}: quant_method {method!r} is not supported (jserve loads compressed-tensors "
                             "W8A16 int8 and FP8 checkpoints, Hugging Face FP8 ones and gpt-oss's MXFP4 experts, "
                             "or quantizes float ones itself with --quantization int8)")
    fmt = qc.get("format")
    if fmt not in (*CT_FORMATS, CT_FP8_FORMAT):
        raise ModelLoadError(f"{where}: format {fmt!r} is not supported; expected one of "
                             f"{(*CT_FORMATS, CT_FP8_FORMAT)}")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ModelLoadError(f"{where}: no config_groups")
    blocks = set()
    for name, group in groups.items():
        w = (group or {}).get("weights") or {}
        got = (w.get("num_bits"), w.get("type"), w.get("symmetric", True), w.get("strategy"))
        if fmt == CT_FP8_FORMAT:
            if got[:3] != (8, "float", True) or got[3] not in ("tensor", "channel", "block"):
                raise ModelLoadError(f"{where}: group {name!r} is not 8-bit float symmetric weights by tensor, "
                                     f"channel or block (weights num_bits/type/symmetric/strategy = {got})")
            if got[3] == "block":
                blocks.add(_block(w.get("block_structure"), f"{where}: group {name!r}'s block_structure"))
        elif got != (8, "int", True, "channel") or (group or {}).get("input_activations"):
            raise ModelLoadError(f"{where}: group {name!r} is not W8A16 int8 symmetric per-channel (weights "
                                 f"num_bits/type/symmetric/strategy = {got}, input_activations "
                                 f"{(group or {}).get('input_activations')!r})")
    if len(blocks) > 1:
        raise ModelLoadError(f"{where}: groups of different block_structure {sorted(blocks)}")
    if fmt == CT_FP8_FORMAT:
        return StoredQuantization("fp8", block=next(iter(blocks), None))
    return StoredQuantization("int8", format=fmt)


def _block(value, where: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if not (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise ModelLoadError(f"{where} must be two positive integers [rows, columns], got {value!r}")
    return int(value[0]), int(value[1])


def unpack_int32(packed: np.ndarray, columns: int) -> np.ndarray:
    """compressed-tensors' pack-quantized 8-bit words [out, ceil(in / 4)] -> int8 [out, columns]."""
    words = np.asarray(packed).view(np.uint32)
    out = np.empty((words.shape[0], words.shape[1] * 4), np.int16)
    for i in range(4):
        out[:, i::4] = (words >> (8 * i)) & 0xFF
    return (out[:, :columns] - 128).astype(np.int8)


def compressed_tensors_tensors(tensors: Iterable[tuple[str, np.ndarray, str]],
                               scales: dict[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray, str]]:
    """A compressed-tensors checkpoint's tensors under their float names: decoder projections as int8 [out, in]
    `X.weight` (their scales, float32 [out], gathered into `scales` by `X.weight` name); any other quantized
    tensor (an LM head not in `ignore`) dequantized to float32. Each projection must be quantized."""
    pending: dict[str, dict[str, tuple[np.ndarray, str]]] = {}
    for name, tensor, origin in tensors:
        base, _, kind = name.rpartition(".")
        if kind in ("weight_scale", "weight_packed", "weight_shape", "weight_zero_point") or (
                kind == "weight" and tensor.dtype == np.int8):
            pending.setdefault(base, {})[kind] = (tensor, origin)
            continue
        if kind == "weight" and base.rsplit(".", 1)[-1] in _PROJECTIONS:
            raise CheckpointError(f"{origin}: {name} is not quantized ({tensor.dtype}); jserve loads W8A16 "
                                  "checkpoints whose every decoder projection is int8")
        yield name, tensor, origin
    for base, parts in pending.items():
        origin = next(iter(parts.values()))[1]
        if "weight_scale" not in parts:
            raise CheckpointError(f"{origin}: {base} has quantized weights but no {base}.weight_scale")
        zero = parts.get("weight_zero_point")
        if zero is not None and np.any(np.asarray(zero[0])):
            raise CheckpointError(f"{origin}: {base}.weight_zero_point is not zero (asymmetric)")
        if "weight_packed" in parts:
            packed = np.asarray(parts["weight_packed"][0])
            shape = parts.get("weight_shape")
            columns = int(np.asarray(shape[0])[1]) if shape is not None else packed.shape[1] * 4
            if packed.dtype != np.int32 or not 0 < columns <= packed.shape[1] * 4:
                raise CheckpointError(f"{origin}: {base}.weight_packed is not int32 words holding {columns} columns")
            q = unpack_int32(packed, columns)
        elif "weight" in parts:
            q = np.asarray(parts["weight"][0])
        else:
            raise CheckpointError(f"{origin}: {base}.weight_scale has no {base}.weight or {base}.weight_packed")
        scale = np.asarray(parts["weight_scale"][0], np.float32).reshape(-1)
        if scale.shape[0] != q.shape[0]:
            raise CheckpointError(f"{origin}: {base}.weight_scale has {scale.shape[0]} values for {q.shape[0]} rows "
                                  "(jserve loads per-channel scales)")
        if base.rsplit(".", 1)[-1] in _PROJECTIONS:
            scales[base + ".weight"] = scale
            yield base + ".weight", q, origin
        else:
            yield base + ".weight", dequantize_rows(q, scale), origin


def load_compressed_tensors_state(model_dir: str | Path, config, shapes: dict[tuple, tuple[tuple[int, ...], np.dtype]],
                                  quantized: set[tuple], place: Callable[[tuple, object], jax.Array],
                                  place_quantized: Callable[[tuple, np.ndarray, np.ndarray], jax.Array]) -> dict:
    """checkpoints.safetensors_loader.load_state for a compressed-tensors W8A16 checkpoint: `shapes` holds the
    quantized paths as int8; each is handed to place_quantized(path, int8 weight, float32 scale) in the model's
    fused row layout (scales fused the same way as their rows), every other parameter to place(path, source)."""
    where = str(model_dir)
    by_name: dict[str, np.ndarray] = {}
    fused: dict[tuple, np.ndarray] = {}

    def place_one(path: tuple, source) -> jax.Array:
        if path not in quantized:
            return place(path, source)
        if not fused:  # every tensor is located (and every scale gathered) before the first parameter is placed
            fused.update(assemble_state(((name, scale[:, None], where) for name, scale in by_name.items()), config,
                                        {p: ((shapes[p][0][0], 1), np.dtype(np.float32)) for p in quantized},
                                        lambda p, src: src.read()[:, 0], where))
        return place_quantized(path, np.asarray(source.read(), np.int8), fused[path])

    tensors = ((name, tensor, str(file)) for file in checkpoint_files(model_dir) for name, tensor in iter_tensors(file))
    return assemble_state(compressed_tensors_tensors(tensors, by_name), config, shapes, place_one, where)
