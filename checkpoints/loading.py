"""Build a jserve model from a Hugging Face checkpoint directory: config, abstract model, weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from checkpoints.safetensors_loader import load_state
from jserve.config import ModelConfig, ModelLoadError
from jserve.models import model_class


@dataclass
class LoadedModel:
    config: ModelConfig
    graphdef: nnx.GraphDef
    state: nnx.State  # parameters as device arrays


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


def load_model(model_dir: str | Path, dtype: str = "float32") -> LoadedModel:
    config = ModelConfig.from_pretrained(model_dir)
    param_dtype = jnp.dtype(dtype)
    abstract = nnx.eval_shape(lambda: model_class(config)(config, param_dtype))
    graphdef, state = nnx.split(abstract)
    pure = nnx.to_pure_dict(state)
    shapes = {path: (leaf.shape, np.dtype(leaf.dtype)) for path, leaf in _flatten(pure)}
    placed = load_state(model_dir, config, shapes, lambda path, array: jax.device_put(array))
    for path, array in placed.items():
        _assign(pure, path, array)
    nnx.replace_by_pure_dict(state, pure)
    return LoadedModel(config=config, graphdef=graphdef, state=state)


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
