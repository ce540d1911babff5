"""`jserve convert`: any checkpoint `--model` takes (a Hugging Face safetensors directory, a GGUF file or a directory
holding one) written as a jserve Orbax checkpoint directory (jserve.orbax_io), which serves without converting
again at every start.

The parameters are loaded exactly as serving loads them (jserve.loading.load_model, unsharded, in the chosen
dtype) and saved as they are. The directory is filled in an order that leaves no half-written directory looking
finished: the parameters, then the config and tokenizer files, then the marker.
"""

from __future__ import annotations

import json
import shutil
from importlib import metadata
from pathlib import Path

import jax
from flax import nnx

from jserve.config import SUPPORTED_DTYPES, ModelLoadError
from jserve.gguf_loading import find_gguf
from jserve.loading import load_model, resolve_model_path, stored_quantization
from jserve.models.quantization import HEAD_SCALE_PATH, SCHEMES
from jserve.orbax_io import (
    FORMAT,
    FORMAT_VERSION,
    MARKER,
    PARAMS_DIR,
    config_to_dict,
    is_orbax_checkpoint,
    param_key,
    read_checkpoint,
)
from jserve.tokenizer import load_tokenizer

# What a Hugging Face checkpoint directory holds besides its weights that serving reads: the config and generation
# config (EOS ids) and every tokenizer file transformers may look for.
_COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
                 "chat_template.jinja", "chat_template.json")


def convert(model: str, out: str | Path, dtype: str = "float32", quantization: str | None = None) -> Path:
    """Write the jserve Orbax checkpoint of `model` (anything --model takes) into the new or empty directory `out`;
    returns its path. quantization: "int8" / "fp8" stores the decoder layers' matrices quantized with their scales
    (jserve.models.quantization), as `--quantization` would make them at every load. ModelLoadError (naming the
    path) for a source that is already converted, an output that already holds a checkpoint or anything else, or
    an unknown dtype or quantization."""
    if dtype not in SUPPORTED_DTYPES:
        raise ModelLoadError(f"dtype must be one of {', '.join(SUPPORTED_DTYPES)}, got {dtype!r}")
    if quantization is not None and quantization not in SCHEMES:
        raise ModelLoadError(f"quantization must be one of {', '.join(SCHEMES)}, got {quantization!r}")
    source = resolve_model_path(model)
    out = Path(out).expanduser()
    if is_orbax_checkpoint(source):
        read_checkpoint(source)  # an unfinished one says so
        raise ModelLoadError(f"{source}: already a jserve Orbax checkpoint (serve it with --model {source}; "
                             "convert its original checkpoint to change the dtype)")
    if out.exists():
        if not out.is_dir():
            raise ModelLoadError(f"{out}: exists and is not a directory")
        if (out / MARKER).is_file():
            raise ModelLoadError(f"{out}: already holds a jserve Orbax checkpoint; choose a new directory or delete "
                                 "this one first")
        if (out / PARAMS_DIR).exists():
            raise ModelLoadError(f"{out}: holds an unfinished conversion ({PARAMS_DIR}/ without {MARKER}); delete "
                                 "it first")
        if any(out.iterdir()):
            raise ModelLoadError(f"{out}: not empty; convert into a new or empty directory (nothing in it is "
                                 "overwritten)")
    gguf_file = find_gguf(source)
    # A GGUF file's tokenizer is built before anything is written: a file without one (no vocabulary) then leaves
    # no unfinished conversion behind.
    tokenizer = load_tokenizer(gguf_file) if gguf_file is not None else None
    loaded = load_model(source, dtype, quantization=quantization)
    # A checkpoint quantized elsewhere (compressed-tensors W8A16) loads as int8 weights with their scales whatever
    # was asked: the marker must say so, or the restore expects float weights and finds scales.
    quantization = quantization or stored_quantization(source)
    out.mkdir(parents=True, exist_ok=True)
    _save_params(loaded.state, out / PARAMS_DIR)
    if tokenizer is None:
        for name in _COPIED_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, out / name)
    else:
        tokenizer.hf.save_pretrained(str(out))
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "dtype": dtype, "jserve_version": _jserve_version(),
            "source": str(gguf_file or source), "model_config": config_to_dict(loaded.config)}
    if quantization is not None:
        meta["quantization"] = quantization
        meta["quantized_head"] = any(tuple(path) == HEAD_SCALE_PATH for path, _ in nnx.to_flat_state(loaded.state))
    (out / MARKER).write_text(json.dumps(meta, indent=1) + "\n")
    return out


def _jserve_version() -> str:
    try:
        return metadata.version("jserve")
    except metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown"


def _save_params(state: nnx.State, path: Path) -> None:
    import orbax.checkpoint as ocp

    flat = {param_key(tuple(p)): var.get_value() for p, var in nnx.to_flat_state(state)}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path.absolute(), flat)
        checkpointer.wait_until_finished()
    jax.effects_barrier()
