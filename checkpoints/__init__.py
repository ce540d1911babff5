"""Checkpoints: Hugging Face safetensors loading onto devices, and the bundled demo model."""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "demo"
