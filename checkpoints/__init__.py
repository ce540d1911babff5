"""Checkpoints: Hugging Face safetensors loading onto devices, and the bundled demo model."""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "demo"


class CheckpointError(ValueError):
    """A checkpoint (its directory, config.json, tokenizer or weight files) cannot be used; the message says which
    file and why. jserve raises it as jserve.config.ModelLoadError, the same class."""
