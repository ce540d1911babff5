"""Build a jserve model from a Hugging Face checkpoint directory: config, abstract model, weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, Sharding

import cpu_kernels
from checkpoints import dummy
from checkpoints.dummy import DummySource
from checkpoints.host_arena import HugePageArena, LayerStacks
from checkpoints.safetensors_loader import ParamSource, load_state
from jserve.config import LOAD_FORMATS, ModelConfig, ModelLoadError
from jserve.models import model_class
from sharding import MODEL_AXIS, logical_sharding, shard_model_config


@dataclass
class LoadedModel:
    config: ModelConfig
    graphdef: nnx.GraphDef
    state: nnx.State  # parameters as device arrays
    attention_backend: str = "reference"  # the concrete backend baked into graphdef
    # The cpu backend's layer weights stacked by kind ([num_layers, ...], aliasing the state's per-layer arrays: see
    # host_arena.LayerStacks), for the layer kernel; None where they could not be stacked without a copy.
    layer_stack: cpu_kernels.LayerWeights | None = None


def resolve_model_path(model: str) -> Path:
    """A local directory as is; otherwise a Hugging Face hub id fetched (or found in the local HF cache)."""
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"{model}: not a directory (expected a checkpoint directory with config.json)")
        return path
    if model.count("/") == 1 and not model.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
        except Exception as e:  # offline, unknown repo, gated: all mean "cannot use this id"
            raise ModelLoadError(f"{model}: no such local directory, and fetching it from the Hugging Face hub "
                                 f"failed ({type(e).__name__}: {e})") from None
    raise ModelLoadError(f"{model}: no such directory")


def load_model(model_dir: str | Path, dtype: str = "float32", attention_backend: str = "reference",
               mesh: Mesh | None = None, weight_parts: int | None = None, load_format: str = "auto") -> LoadedModel:
    """load_format: "auto" reads the directory's safetensors; "dummy" draws random weights of config.json's shape
    (checkpoints.dummy) and needs no weight files.

    attention_backend: a concrete backend (pallas_kernels.resolve_backend), baked into the graphdef.

    weight_parts: where the cpu backend packs the layers' matrices, they are laid out in this many per-thread parts
    (cpu_kernels.PartLayout; None: one per CPU the kernels run on, cpu_kernels.kernel_threads(); 0: as [num_layers,
    ...] stacks whose slices are the layers' own parameters). In parts, only the layer kernel reads them (through
    LoadedModel.layer_stack): each layer's own matrix parameters are empty placeholders.

    With a mesh, the model is reshaped for its `model` axis (sharding.shard_model_config) and every parameter is
    built shard by shard in the layout the rules table gives its logical axes: no device, and no host buffer,
    ever holds a whole copy of a sharded weight.
    """
    config = ModelConfig.from_pretrained(model_dir)
    if mesh is not None:
        config = shard_model_config(config, mesh.shape[MODEL_AXIS])
    param_dtype = jnp.dtype(dtype)
    abstract = nnx.eval_shape(lambda: model_class(config)(config, param_dtype, attention_backend))
    graphdef, state = nnx.split(abstract)
    pure = nnx.to_pure_dict(state)
    shapes = {path: (leaf.shape, np.dtype(leaf.dtype)) for path, leaf in _flatten(pure)}
    axes = {tuple(path): var.get_metadata().get("logical_axes") for path, var in nnx.to_flat_state(state)}

    packed = _packed_paths(config, param_dtype) if _packs_weights(attention_backend, param_dtype, mesh) else set()

    arena = HugePageArena() if attention_backend == "cpu" and mesh is None else None
    stack_paths = getattr(model_class(config), "kernel_weight_paths", None)
    stacks = None
    if arena is not None and stack_paths is not None:
        matrices = (stack_paths.qkv, stack_paths.o, stack_paths.gate_up, stack_paths.down)
        in_parts = weight_parts != 0 and all(("layers", 0, *path) in packed for path in matrices)
        parts = weight_parts if weight_parts is not None else cpu_kernels.kernel_threads()
        layout = cpu_kernels.part_layout(_matrix_shapes(config), param_dtype, parts) if in_parts else None
        stacks = LayerStacks(arena, config.num_layers,
                             (layout, {path: i for i, path in enumerate(matrices)}) if in_parts else None)

    def place(path: tuple, source: ParamSource) -> jax.Array:
        if mesh is None:
            array = source.read()
            array = cpu_kernels.pack_weight(array) if path in packed else array
            if stacks is not None and path[0] == "layers":
                return stacks.place(path[2:], path[1], array)
            return jax.device_put(array) if arena is None else arena.place(array)
        return place_sharded(source, logical_sharding(mesh, axes[path], source.shape))

    if load_format == "dummy":
        placed = _dummy_state(shapes, axes, mesh, place, through_host=arena is not None or bool(packed))
    elif load_format == "auto":
        placed = load_state(model_dir, config, shapes, place)
    else:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    for path, array in placed.items():
        _assign(pure, path, array)
    nnx.replace_by_pure_dict(state, pure)
    layer_stack = _layer_stack(stacks, stack_paths) if stacks is not None else None
    return LoadedModel(config=config, graphdef=graphdef, state=state, attention_backend=attention_backend,
                       layer_stack=layer_stack)


def _dummy_state(shapes: dict, axes: dict, mesh: Mesh | None, place, through_host: bool) -> dict[tuple, jax.Array]:
    """Random parameters: drawn where they live, or, where the CPU layer kernel packs and stacks host arrays, drawn
    on the CPU and placed one at a time as a checkpoint's would be."""
    if through_host:
        return {path: place(path, DummySource(array)) for path, array in dummy.draw(shapes, lambda path: None)}
    if mesh is None:
        return dict(dummy.draw(shapes, lambda path: None))
    return dict(dummy.draw(shapes, lambda path: logical_sharding(mesh, axes[path], shapes[path][0])))


def _matrix_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """[N, K] of a layer's qkv, o, gate_up and down weights."""
    e, q, kv, i = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    return [(q + 2 * kv, e), (e, q), (2 * i, e), (e, i)]


def _layer_stack(stacks: LayerStacks, paths: cpu_kernels.LayerWeights) -> cpu_kernels.LayerWeights | None:
    """The kernel's weights from the stacks by kind (and the matrices' parts); None if a stack is missing or the
    layers hold a weight the kernel does not take."""
    by_kind, matrix_parts = stacks.stacked(), stacks.matrix_parts()
    if by_kind is None or not set(by_kind) <= set(paths):
        if matrix_parts is not None:
            raise ModelLoadError("the layer kernel's weights could not all be stacked (a layer holds a weight it "
                                 "does not take), but its matrices are already laid out only for it")
        return None
    weights = cpu_kernels.LayerWeights(*(by_kind.get(path) for path in paths[:-1]), matrix_parts=matrix_parts)
    matrices = (weights.qkv, weights.o, weights.gate_up, weights.down)
    whole = matrix_parts is not None or all(w is not None for w in matrices)
    return weights if whole and weights.input_norm is not None and weights.post_norm is not None else None


def _packs_weights(attention_backend: str, dtype: jnp.dtype, mesh: Mesh | None) -> bool:
    """The cpu backend packs matmul weights once for its kernels (cpu_kernels.pack_weight), unsharded."""
    return attention_backend == "cpu" and mesh is None and cpu_kernels.packs_weights(dtype)


def _packed_paths(config: ModelConfig, dtype: jnp.dtype) -> set[tuple]:
    """The parameters only the kernels' matmuls read: every projection and the LM head (a tied embedding table
    too: its lookup reads the packed rows, cpu_kernels.packed_rows)."""
    projections = [("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj")]
    paths = {("layers", i, *module, "weight") for i in range(config.num_layers) for module in projections}
    paths.add(("embed_tokens",) if config.tie_word_embeddings else ("lm_head",))
    sizes = (config.hidden_size, config.q_size, config.intermediate_size)
    if dtype == jnp.bfloat16 and any(size % 2 for size in sizes):
        return set()  # the bfloat16 layout pairs adjacent inputs
    return paths


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
