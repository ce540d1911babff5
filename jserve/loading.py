"""Build a jserve model from a Hugging Face checkpoint directory or a GGUF file: config, abstract model, weights on
the mesh."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, Sharding

from checkpoints import dummy, is_gguf_file
from checkpoints.dummy import DummySource
from checkpoints.fp8 import fp8_tensors
from checkpoints.safetensors_loader import ParamSource, hf_names, load_state
from jserve.config import LOAD_FORMATS, ModelConfig, ModelLoadError
from jserve.gguf_loading import GGUF_ARCHITECTURE_OF, find_gguf, gguf_model_config, gguf_tensor_name, load_gguf_state
from jserve.models import model_class
from jserve.models.layers import LoraWeight
from jserve.models.quantization import (
    checkpoint_quantization,
    load_compressed_tensors_state,
    quantize_model,
    quantize_rows,
    quantize_rows_on_device,
    resident_bytes,
    scale_path,
)
from jserve.models.sharded_config import shard_model_config
from jserve.orbax_io import is_orbax_checkpoint, read_checkpoint, restore_state
from sharding import MODEL_AXIS, logical_sharding

logger = logging.getLogger(__name__)

Place = Callable[[tuple, ParamSource], jax.Array]  # (parameter path, its source) -> the array the model holds
# (weight path, int8 weight [out, in], float32 scale [out]) -> the arrays the model holds as its weight and its scale
PlaceQuantized = Callable[[tuple, np.ndarray, np.ndarray], tuple[jax.Array, jax.Array]]


@dataclass
class LoadedModel:
    config: ModelConfig
    graphdef: nnx.GraphDef
    state: nnx.State  # parameters as device arrays
    attention_backend: str = "reference"  # the concrete backend baked into graphdef

    def resident_bytes(self) -> int:
        """Bytes of the parameters as they are held (quantized weights and their scales as stored)."""
        return resident_bytes(self.state)


def resolve_model_path(model: str) -> Path:
    """A local directory as is (its GGUF file where it holds one and no safetensors) or a local GGUF file (named
    .gguf, or an Ollama blob); otherwise a Hugging Face hub id fetched (or found in the local HF cache)."""
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir() and not is_gguf_file(path):
            raise ModelLoadError(f"{model}: not a directory or a GGUF file (expected a checkpoint directory with "
                                 "config.json, or a GGUF file)")
        return find_gguf(path) or path
    if path.suffix == ".gguf":  # a file's name, not a hub id (the hub fetch takes no .gguf files)
        raise ModelLoadError(f"{model}: no such GGUF file")
    if model.count("/") == 1 and not model.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
        except Exception as e:  # offline, unknown repo, gated: all mean "cannot use this id"
            raise ModelLoadError(f"{model}: no such local directory, and fetching it from the Hugging Face hub "
                                 f"failed ({type(e).__name__}: {e})") from None
    raise ModelLoadError(f"{model}: no such file or directory")


def model_config(model_path: str | Path, max_model_len: int | None = None) -> ModelConfig:
    """The ModelConfig of a checkpoint directory (its config.json), of a GGUF file (its metadata) or of a directory
    jserve convert wrote (its marker), for a context of max_model_len tokens (None: the model's limit; see
    ModelConfig.for_context)."""
    if is_orbax_checkpoint(model_path):
        return read_checkpoint(model_path).config.for_context(max_model_len)
    gguf_file = find_gguf(model_path)
    config = gguf_model_config(gguf_file) if gguf_file is not None else ModelConfig.from_pretrained(model_path)
    return config.for_context(max_model_len)


def stored_quantization(model_dir: str | Path, load_format: str = "auto") -> str | None:
    """The scheme a checkpoint's weights are stored in, which serving keeps: a compressed-tensors W8A16
    checkpoint's "int8", a quantized jserve conversion's scheme; None for float weights (an FP8 checkpoint's are
    dequantized as they are read) or dummy ones."""
    if load_format != "auto":
        return None
    if is_orbax_checkpoint(model_dir):
        return read_checkpoint(model_dir).quantization
    stored = checkpoint_quantization(model_dir)
    return "int8" if stored is not None and stored.method == "int8" else None


def served_quantization(model_dir: str | Path, load_format: str, platform: str) -> str | None:
    """The weights' scheme where none is asked for: the stored one (stored_quantization), or for an FP8 checkpoint
    one byte a weight again, requantized per row as its float weights are read: fp8 on a GPU, int8 elsewhere (the
    scheme each platform multiplies fast)."""
    stored = stored_quantization(model_dir, load_format)
    if stored is not None or load_format != "auto" or is_orbax_checkpoint(model_dir):
        return stored
    fp8 = checkpoint_quantization(model_dir)
    if fp8 is None or fp8.method != "fp8":
        return None
    return "fp8" if platform == "gpu" else "int8"


def load_model(model_dir: str | Path, dtype: str = "float32", attention_backend: str = "reference",
               mesh: Mesh | None = None, load_format: str = "auto", place: Place | None = None,
               quantization: str | None = None, place_quantized: PlaceQuantized | None = None,
               max_model_len: int | None = None, lora: tuple[int, int] = (0, 0), pooling: bool = False) -> LoadedModel:
    """model_dir: a Hugging Face checkpoint directory, a GGUF file, or a directory holding one GGUF file (and no
    safetensors; jserve.gguf_loading). max_model_len: the context the model is loaded for (ModelConfig.for_context).

    load_format: "auto" reads the checkpoint's weights (a GGUF file's dequantized into dtype); "dummy" draws random
    weights of the checkpoint's shape (checkpoints.dummy) and reads none.

    attention_backend: a concrete backend (pallas_kernels.resolve_backend), baked into the graphdef.

    With a mesh, the model is reshaped for its `model` axis (jserve.models.sharded_config) and every parameter is
    built shard by shard in the layout the rules table gives its logical axes: no device, and no host buffer,
    ever holds a whole copy of a sharded weight.

    place: where an executor keeps its parameters its own way (the CPU layer executor packs and stacks them in host
    memory), the function that turns each parameter's source into the array the state holds; unsharded only.

    pooling: the model of an embedding engine (pooling_config): no LM head, its output the final hidden states.

    lora: (max_loras, max_lora_rank) where the engine serves LoRA adapters: each decoder projection gets that many
    adapter slots (jserve.models.layers.LoraWeight), zeros until the executor writes an adapter into one.

    quantization: "int8" / "fp8" quantizes the decoder layers' projection matrices as they are read
    (jserve.models.quantization): each is read whole on the host, quantized per output row and placed with its scales
    (dummy weights on the XLA path are drawn and quantized on their devices).
    With `place`, quantized weights need `place_quantized`, which takes each weight with its scales (read as stored,
    or quantized at load) and gives the arrays the state holds for both (the CPU layer executor packs them together).
    """
    orbax = read_checkpoint(model_dir) if is_orbax_checkpoint(model_dir) else None  # jserve convert's output
    gguf_file = None if orbax is not None else find_gguf(model_dir)
    config = (orbax.config.for_context(max_model_len) if orbax is not None
              else model_config(gguf_file or model_dir, max_model_len))
    if config.rope_scaling.kind == "longrope":
        scaling = config.rope_scaling
        logger.info("longrope: %s factors for every sequence (a context of %d tokens; original_max_position_embeddings "
                    "%d)", "long" if scaling.use_long_factors else "short",
                    max_model_len or config.max_position_embeddings, scaling.original_max_position_embeddings)
    # A compressed-tensors W8A16 checkpoint loads its int8 weights and scales as they are; an FP8 one's are read as
    # the float weights they stand for (checkpoints.fp8), then quantized as any float weight is, if asked.
    stored = None if orbax is not None or gguf_file is not None else checkpoint_quantization(model_dir)
    prequantized = stored.format if stored is not None and stored.method == "int8" else None
    fp8 = functools.partial(fp8_tensors, block=stored.block) if stored is not None and stored.method == "fp8" else None
    if prequantized is not None and load_format == "auto":
        if quantization not in (None, "int8"):
            raise ValueError(f"{model_dir} holds int8 weights (compressed-tensors); quantization {quantization!r} "
                             "does not apply to them")
        quantization = "int8"
    # A conversion with --quantization holds the quantized weights and their scales: restored as they are.
    stored_quantized = orbax is not None and orbax.quantization is not None and load_format == "auto"
    if stored_quantized:
        if quantization not in (None, orbax.quantization):
            raise ValueError(f"{model_dir} holds {orbax.quantization} weights (jserve convert --quantization "
                             f"{orbax.quantization}); quantization {quantization!r} does not apply to them")
        quantization = orbax.quantization
    if lora[0]:
        config = dataclasses.replace(config, max_loras=lora[0], max_lora_rank=lora[1])
    if pooling:
        config = pooling_config(config)
    if mesh is not None:
        if place is not None:
            raise ValueError("load_model: a custom placement is for unsharded models only")
        config = shard_model_config(config, mesh.shape[MODEL_AXIS])
    abstract = nnx.eval_shape(lambda: model_class(config)(config, jnp.dtype(dtype), attention_backend))
    quantized = set()
    if quantization is not None:
        if place is not None and place_quantized is None:
            raise ValueError("load_model: a custom placement of quantized weights needs place_quantized")
        # Checkpoints quantized elsewhere keep the head they store; a conversion says whether it quantized its own.
        head = (False if (prequantized is not None and load_format == "auto") or pooling
                else orbax.quantized_head if stored_quantized else None)
        quantized = set(quantize_model(abstract, quantization, head))
    graphdef, state = nnx.split(abstract)
    pure = nnx.to_pure_dict(state)
    # A quantized weight is read from the checkpoint in `dtype` and its scale made from it, or, from a quantized
    # conversion, both are read as stored.
    scales = set() if stored_quantized else {scale_path(path) for path in quantized}
    # Dummy weights of a compressed-tensors checkpoint are drawn in dtype and quantized like any float weight (drawn
    # as int8, normal(0, 0.02) rounds to zeros).
    read_as = np.dtype(np.int8) if prequantized is not None and load_format == "auto" else np.dtype(dtype)
    flat_state = list(nnx.to_flat_state(state))
    adapters = {tuple(path): var for path, var in flat_state if isinstance(var, LoraWeight)}  # not in checkpoints
    shapes = {path: (leaf.shape, read_as if path in quantized and not stored_quantized else np.dtype(leaf.dtype))
              for path, leaf in _flatten(pure) if path not in scales and path not in adapters}
    axes = {tuple(path): var.get_metadata().get("logical_axes") for path, var in flat_state}
    placed_scales: dict[tuple, jax.Array] = {}

    def place_array(path: tuple, array: np.ndarray) -> jax.Array:
        if mesh is None:
            return jax.device_put(array)
        return place_sharded(DummySource(array), logical_sharding(mesh, axes[path], array.shape))

    def place_quantized_one(path: tuple, q: np.ndarray, scale: np.ndarray) -> jax.Array:
        if place_quantized is not None:
            weight, placed_scales[scale_path(path)] = place_quantized(path, q, scale)
            return weight
        placed_scales[scale_path(path)] = place_array(scale_path(path), scale)
        return place_array(path, q)

    # A stored conversion's weights and scales are separate parameters: a custom placement takes each weight once
    # both have been read (until then the state holds an empty placeholder for either).
    stored_parts: dict[tuple, dict[str, np.ndarray]] = {}
    weight_of_scale = {scale_path(path): path for path in quantized}

    def place_stored(path: tuple, source: ParamSource) -> jax.Array:
        weight = weight_of_scale.get(path, path)
        parts = stored_parts.setdefault(weight, {})
        parts["scale" if path in weight_of_scale else "weight"] = np.asarray(source.read())
        if len(parts) == 2:
            placed_scales[weight] = place_quantized_one(weight, parts["weight"].astype(np.int8), parts["scale"])
            del stored_parts[weight]
        return jnp.zeros((0,), jnp.float32)

    def place_one(path: tuple, source: ParamSource) -> jax.Array:
        if path in quantized and not stored_quantized:
            try:
                rows = quantize_rows(np.asarray(source.read()), quantization)
            except ValueError as e:  # inf or NaN: its message names no tensor
                names = hf_names(path)  # a GGUF file's own tensor names where the source is one
                arch = GGUF_ARCHITECTURE_OF.get(config.model_type, "llama")
                names = names if gguf_file is None else "/".join(gguf_tensor_name(n, arch) for n in names.split("/"))
                raise ModelLoadError(f"{model_dir}: cannot quantize {names} to {quantization} ({e})") from None
            return place_quantized_one(path, *rows)
        if stored_quantized and place_quantized is not None and (path in quantized or path in weight_of_scale):
            return place_stored(path, source)
        if place is not None:
            return place(path, source)
        if mesh is None:
            return jax.device_put(source.read())
        return place_sharded(source, logical_sharding(mesh, axes[path], source.shape))

    def sharding_of(path: tuple, shape: tuple) -> Sharding | None:
        return None if mesh is None else logical_sharding(mesh, axes[path], shape)

    def quantize_drawn(path: tuple, weight: jax.Array) -> jax.Array:  # a dummy weight, quantized on its devices
        scale = scale_path(path)
        shardings = None if mesh is None else (sharding_of(path, weight.shape), sharding_of(scale, weight.shape[:1]))
        q, placed_scales[scale] = quantize_rows_on_device(weight, quantization, shardings)
        return q

    if load_format == "dummy" and place is None:  # drawn (and quantized) where they live
        placed = {path: quantize_drawn(path, array) if path in quantized else array
                  for path, array in dummy.draw(shapes, lambda path: sharding_of(path, shapes[path][0]))}
    elif load_format == "dummy":  # drawn on the CPU and placed one at a time, as a checkpoint's would be
        placed = {path: place_one(path, DummySource(array)) for path, array in dummy.draw(shapes, lambda path: None)}
    elif load_format == "auto" and orbax is not None:
        # restored where they live; through place_one only where a parameter is packed or quantized from the host
        placed = restore_state(orbax, dtype, shapes, axes, mesh, config,
                               place_one if place is not None or (quantized and not stored_quantized) else None)
    elif load_format == "auto" and gguf_file is not None:
        placed = load_gguf_state(gguf_file, config, shapes, place_one)
    elif load_format == "auto" and prequantized is not None:
        placed = load_compressed_tensors_state(model_dir, config, shapes, quantized, place_one, place_quantized_one)
    elif load_format == "auto":
        placed = load_state(model_dir, config, shapes, place_one, fp8)
    else:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    placed.update(placed_scales)
    abstract_leaves = dict(_flatten(pure))
    for path in adapters:  # empty slots, placed as their rules say
        zeros = np.zeros(abstract_leaves[path].shape, abstract_leaves[path].dtype)
        placed[path] = jax.device_put(zeros) if mesh is None else place_sharded(
            DummySource(zeros), logical_sharding(mesh, axes[path], zeros.shape))
    for path, array in placed.items():
        _assign(pure, path, array)
    nnx.replace_by_pure_dict(state, pure)
    return LoadedModel(config=config, graphdef=graphdef, state=state, attention_backend=attention_backend)


def pooling_config(config: ModelConfig) -> ModelConfig:
    """The config of a model loaded for embeddings: its output the final norm's hidden states, no LM head (a
    checkpoint's lm_head is left unread, as for a tied one; the embedding table is only looked up)."""
    return dataclasses.replace(config, pooling=True, tie_word_embeddings=True)


def place_sharded(source: ParamSource, sharding: Sharding) -> jax.Array:
    """Build a global array shard by shard: each device's block is read from the memory map and sent before the
    next is read. (jax.make_array_from_callback would first read every device's block, holding the whole
    parameter on the host at once.) Only this process's devices are filled, so it works under jax.distributed.
    """
    shards = [jax.device_put(source.read(index), device)
              for device, index in sharding.addressable_devices_indices_map(source.shape).items()]
    return jax.make_array_from_single_device_arrays(source.shape, sharding, shards)


def _flatten(tree: dict, prefix: tuple = ()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def _assign(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value
