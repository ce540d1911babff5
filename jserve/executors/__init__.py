"""Executors: what runs the model for the engine (one interface, base.Executor), and the choice between them."""

from __future__ import annotations

import logging

import jax

import cpu_kernels
from jserve.executors.base import Executor, StepOutput, WarmupReport
from jserve.executors.cpu_layers import CpuLayerExecutor
from jserve.executors.xla import XlaExecutor
from pallas_kernels import resolve_backend

logger = logging.getLogger(__name__)


def choose_executor(executor: str, attention_backend: str, *, sharded: bool = False,
                    platform: str | None = None, quantization: str | None = None) -> tuple[type[XlaExecutor], str, str]:
    """-> (executor class, concrete attention backend, why) for the EngineConfig settings `executor`,
    `attention_backend` and `quantization` on this platform; sharded: the model is split over a mesh."""
    platform = platform or jax.default_backend()
    if quantization == "fp8" and platform != "gpu":
        raise ValueError(f"fp8 weights need a GPU (platform is {platform!r}); use int8")
    if executor == "auto":
        if platform != "cpu":
            executor, why = "xla", f"the platform is {platform}"
        elif attention_backend not in ("auto", "cpu"):
            executor, why = "xla", f"attention_backend {attention_backend!r} runs under XLA"
        elif sharded:
            executor, why = "xla", "the model is sharded (the layer kernel runs on one device)"
        elif quantization is not None:
            executor, why = "xla", f"{quantization} weights (the C++ layer kernels have no {quantization} matmul)"
        elif not cpu_kernels.available():
            executor, why = "xla", f"the C++ kernels are unavailable ({cpu_kernels.unavailable_reason()})"
        else:
            executor, why = "cpu-layers", "one CPU device and the C++ kernels built here"
    else:
        why = "asked for"
    if executor == "cpu-layers":
        if platform != "cpu":
            raise ValueError(f"executor 'cpu-layers' runs on the CPU only (platform is {platform!r})")
        if not cpu_kernels.available():
            raise ValueError(f"executor 'cpu-layers' is unavailable: {cpu_kernels.unavailable_reason()}")
        if quantization is not None:
            raise ValueError(f"executor 'cpu-layers' has no {quantization} matmul kernels; quantization "
                             f"{quantization!r} needs executor 'xla' (or 'auto')")
        if attention_backend not in ("auto", "cpu"):
            raise ValueError(f"executor 'cpu-layers' runs its own attention (the C++ kernel); attention_backend "
                             f"{attention_backend!r} needs executor 'xla'")
        return CpuLayerExecutor, "cpu", why
    if executor != "xla":
        raise ValueError(f"unknown executor {executor!r}")
    return XlaExecutor, resolve_backend(attention_backend, platform), why


__all__ = ["CpuLayerExecutor", "Executor", "StepOutput", "WarmupReport", "XlaExecutor", "choose_executor"]
