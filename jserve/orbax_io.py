"""jserve's Orbax checkpoints: a directory holding the model's parameters as an Orbax checkpoint in exactly the
layout the loader builds (the unsharded nnx state, fused q|k|v and gate|up included, in one dtype), the ModelConfig
jserve derived, the tokenizer files and a marker file (MARKER) naming the format, dtype and jserve version.

Restoring skips everything a safetensors or GGUF load does per start (locating tensors, fusing rows, converting
dtypes, dequantizing): each parameter is read straight onto the devices that hold it, each device reading only its
own shard (Orbax's sharded restore with the loader's target shardings). Under tensor parallelism the fused
parameters' rows are stored in the unsharded order; they are restored split by rows and then moved into the
tensor-parallel row blocks (jserve.models.sharded_config) on the devices, so no host buffer holds a whole weight.

`jserve convert` (jserve.convert) writes these directories.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from checkpoints.dummy import DummySource
from checkpoints.safetensors_loader import FUSED_PARTS, fused_row_map
from jserve.config import SUPPORTED_DTYPES, ModelConfig, ModelLoadError
from jserve.config_json import RopeScaling
from jserve.models import model_class
from jserve.models.quantization import SCHEMES, quantize_model
from sharding import MODEL_AXIS, logical_sharding

FORMAT = "jserve-orbax"
FORMAT_VERSION = 1
MARKER = "jserve_checkpoint.json"  # written last: a directory without it is no (finished) checkpoint
PARAMS_DIR = "params"  # the Orbax checkpoint inside the directory


@dataclass(frozen=True)
class OrbaxCheckpoint:
    """A converted directory as its marker describes it."""

    path: Path
    dtype: str
    config: ModelConfig  # the unsharded model's (tensor parallelism reshapes it at load)
    jserve_version: str
    source: str
    quantization: str | None = None  # "int8" / "fp8": the decoder layers' matrices stored quantized, with scales
    quantized_head: bool = False  # the LM head stored quantized too (head_scale beside it)

    @property
    def params_dir(self) -> Path:
        return self.path / PARAMS_DIR


def is_orbax_checkpoint(path: str | Path) -> bool:
    """Whether path is a directory jserve convert wrote (it holds the marker file) or began to write (its
    parameters without the marker: read_checkpoint says so rather than it being read as a Hugging Face directory)."""
    path = Path(path)
    return (path / MARKER).is_file() or (path / PARAMS_DIR / "_CHECKPOINT_METADATA").is_file()


def read_checkpoint(path: str | Path) -> OrbaxCheckpoint:
    """The marker of a converted directory, checked: ModelLoadError naming the file and what is wrong."""
    path = Path(path)
    marker = path / MARKER
    if not marker.is_file():
        raise ModelLoadError(f"{path}: an unfinished jserve conversion ({PARAMS_DIR}/ but no {MARKER}); delete it "
                             "and convert again")
    try:
        meta = json.loads(marker.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{marker}: cannot read the jserve checkpoint marker ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise ModelLoadError(f"{marker}: not a {FORMAT} marker (format {found!r})")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ModelLoadError(f"{marker}: format version {meta.get('format_version')!r}; this jserve reads "
                             f"version {FORMAT_VERSION} (convert the source again)")
    if meta.get("dtype") not in SUPPORTED_DTYPES:
        raise ModelLoadError(f"{marker}: dtype {meta.get('dtype')!r} is not one of {', '.join(SUPPORTED_DTYPES)}")
    try:
        config = config_from_dict(meta["model_config"])
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{marker}: bad model_config ({type(e).__name__}: {e})") from None
    if not (path / PARAMS_DIR).is_dir():
        raise ModelLoadError(f"{path}: no {PARAMS_DIR}/ directory (the Orbax checkpoint of the parameters is "
                             "missing)")
    quantization = meta.get("quantization")
    if quantization is not None and quantization not in SCHEMES:
        raise ModelLoadError(f"{marker}: quantization {quantization!r} is not one of {', '.join(SCHEMES)}")
    return OrbaxCheckpoint(path=path, dtype=meta["dtype"], config=config, quantization=quantization,
                           jserve_version=str(meta.get("jserve_version")), source=str(meta.get("source")),
                           quantized_head=bool(meta.get("quantized_head", False)))


def config_to_dict(config: ModelConfig) -> dict:
    return dataclasses.asdict(config)


def config_from_dict(data: dict) -> ModelConfig:
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = set(data) - fields
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}")
    data = dict(data)
    rope = dict(data.get("rope_scaling") or {})
    for key in ("freq_factors", "short_factors", "long_factors"):
        rope[key] = tuple(rope.get(key, ()))
    data["rope_scaling"] = RopeScaling(**rope)
    data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
    # JSON keeps these as lists; the config must stay hashable
    for key in ("sliding_layers", "rope_layers", "moe_layers"):
        if data.get(key) is not None:
            data[key] = tuple(data[key])
    if data.get("fused_shards", 1) != 1 or data.get("kv_head_replicas", 1) != 1:
        raise ValueError("a stored config is the unsharded model's (fused_shards and kv_head_replicas 1)")
    return ModelConfig(**data)


def param_key(path: tuple) -> str:
    """A state path as the flat Orbax tree's key ("layers/0/self_attn/qkv_proj/kernel")."""
    return "/".join(map(str, path))


def unsharded_shapes(config: ModelConfig, dtype: str, quantization: str | None = None,
                     quantized_head: bool = False) -> dict[tuple, tuple[tuple[int, ...], np.dtype]]:
    """{state path: (shape, dtype)} of the unsharded model: what a checkpoint of this config must hold."""
    abstract = nnx.eval_shape(lambda: model_class(config)(config, jnp.dtype(dtype), "reference"))
    if quantization is not None:
        quantize_model(abstract, quantization, quantized_head)
    _, state = nnx.split(abstract)
    return {tuple(path): (tuple(var.get_value().shape), np.dtype(var.get_value().dtype))
            for path, var in nnx.to_flat_state(state)}


def restore_state(ckpt: OrbaxCheckpoint, dtype: str, shapes: dict[tuple, tuple[tuple[int, ...], np.dtype]],
                  axes: dict[tuple, tuple | None], mesh: Mesh | None, config: ModelConfig,
                  place: Callable | None = None) -> dict[tuple, jax.Array]:
    """Every parameter of `shapes` (the state the loader builds for `config`, sharded for the mesh) restored from
    the checkpoint. With a mesh each device reads only its shard; with `place` (an executor's own placement, one
    device) each parameter is restored onto the device and handed to place as a source, one at a time."""
    if dtype != ckpt.dtype:
        raise ModelLoadError(f"{ckpt.path}: the checkpoint holds {ckpt.dtype} parameters but dtype {dtype!r} was "
                             f"asked for (pass --dtype {ckpt.dtype}, or convert the source again with --dtype "
                             f"{dtype})")
    stored = _check_stored(ckpt)
    if mesh is None:
        device = jax.devices()[0]
        targets = {p: jax.sharding.SingleDeviceSharding(device) for p in shapes}
    else:
        targets = {p: logical_sharding(mesh, axes[p], shapes[p][0]) for p in shapes}
    fused = {p for p in shapes if config.fused_shards > 1 and len(p) >= 2 and p[-2] in FUSED_PARTS}
    read_as = {p: targets[p] if p not in fused else _row_split(mesh, stored[p][0]) for p in shapes}
    abstract = {param_key(p): jax.ShapeDtypeStruct(stored[p][0], stored[p][1], sharding=read_as[p]) for p in shapes}
    restored = _restore(ckpt, abstract)
    placed: dict[tuple, jax.Array] = {}
    for path in shapes:
        array = restored.pop(param_key(path))
        if path in fused:
            array = _to_tp_layout(array, config, path, targets[path])
        placed[path] = place(path, DummySource(array)) if place is not None else array
    return placed


def _check_stored(ckpt: OrbaxCheckpoint) -> dict[tuple, tuple[tuple[int, ...], np.dtype]]:
    """The stored arrays' shapes, checked against the config's unsharded shapes (ModelLoadError on any mismatch)."""
    import orbax.checkpoint as ocp

    expected = unsharded_shapes(ckpt.config, ckpt.dtype, ckpt.quantization, ckpt.quantized_head)
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            tree = checkpointer.metadata(ckpt.params_dir.absolute()).item_metadata
    except Exception as e:  # orbax raises FileNotFoundError, ValueError, tensorstore errors ...
        raise ModelLoadError(f"{ckpt.params_dir}: cannot read the Orbax checkpoint's metadata (truncated or "
                             f"damaged?): {type(e).__name__}: {e}") from None
    if not tree:  # orbax logs a warning and returns None where the tree's metadata files are gone
        raise ModelLoadError(f"{ckpt.params_dir}: cannot read the Orbax checkpoint's metadata (truncated or damaged? "
                             "convert the source again)")
    stored = {key: (tuple(m.shape), np.dtype(m.dtype)) for key, m in dict(tree).items()}
    by_key = {param_key(p): p for p in expected}
    missing = sorted(set(by_key) - set(stored))
    extra = sorted(set(stored) - set(by_key))
    if missing or extra:
        raise ModelLoadError(f"{ckpt.path}: the stored parameters do not match the model's configuration "
                             f"({MARKER}): missing {missing[:6]}, unexpected {extra[:6]}")
    for key, path in by_key.items():
        if stored[key] != expected[path]:
            shape, dt = stored[key]
            raise ModelLoadError(f"{ckpt.path}: stored parameter {key} has shape {list(shape)} ({dt}), but the "
                                 f"model's configuration ({MARKER}) gives {list(expected[path][0])} "
                                 f"({expected[path][1]})")
    return {path: stored[key] for key, path in by_key.items()}


def _restore(ckpt: OrbaxCheckpoint, abstract: dict) -> dict:
    import orbax.checkpoint as ocp

    try:
        with ocp.StandardCheckpointer() as checkpointer:
            return dict(checkpointer.restore(ckpt.params_dir.absolute(), abstract))
    except Exception as e:  # a deleted or cut data file surfaces as a tensorstore or OS error
        raise ModelLoadError(f"{ckpt.params_dir}: cannot restore the Orbax checkpoint (truncated or damaged? "
                             f"convert the source again): {type(e).__name__}: {e}") from None


def _row_split(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """How a fused parameter is read under tensor parallelism: its stored rows split over the model axis (where
    they divide evenly, else whole on each device), so each device reads a slice, never the whole weight."""
    spec = PartitionSpec(MODEL_AXIS) if shape[0] % mesh.shape[MODEL_AXIS] == 0 else PartitionSpec()
    return NamedSharding(mesh, spec)


def _to_tp_layout(array: jax.Array, config: ModelConfig, path: tuple, target: NamedSharding) -> jax.Array:
    """A fused parameter in the unsharded row order moved into the tensor-parallel row blocks (and replicated KV
    heads) the loader lays out: one on-device row gather into the target sharding."""
    base = dataclasses.replace(config, fused_shards=1, kv_head_replicas=1,
                               num_kv_heads=config.num_kv_heads // config.kv_head_replicas)
    row_map = fused_row_map(config, path[-2], array.shape[0])  # gate|up: as many rows in either layout
    rows = np.empty(sum(len(dest) for dest, _ in row_map.values()), np.int32)
    offset = 0
    for part, (dest, src) in row_map.items():
        rows[dest] = offset + src
        offset += len(fused_row_map(base, path[-2], array.shape[0])[part][1])
    return jax.jit(lambda a, r: a[r], out_shardings=target)(array, jnp.asarray(rows))
