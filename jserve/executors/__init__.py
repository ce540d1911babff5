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
                    platform: str | None = None, quantization: str | None = None,
                    kv_cache_dtype: str = "auto") -> tuple[type[XlaExecutor], str, str]:
    """-> (executor class, concrete attention backend, why) for the EngineConfig settings `executor`,
    `attention_backend`, `quantization` and `kv_cache_dtype` on this platform; sharded: the model is split over a
    mesh. The C++ kernels read an int8 KV cache but not an fp8 one: fp8 runs on the XLA executor, whose "auto"
    attention on CPU is then the reference. int8 weights run on either executor (the C++ layer kernels widen them in
    registers); fp8 weights need a GPU."""
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
        elif quantization not in (None, "int8"):
            executor, why = "xla", f"{quantization} weights (the C++ layer kernels have no {quantization} matmul)"
        elif kv_cache_dtype == "fp8":
            executor, why = "xla", "kv_cache_dtype fp8 (the C++ kernels read int8 pages, not fp8 ones)"
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
        if quantization not in (None, "int8"):
            raise ValueError(f"executor 'cpu-layers' has no {quantization} matmul kernels (int8 only); quantization "
                             f"{quantization!r} needs executor 'xla' (or 'auto')")
        if kv_cache_dtype == "fp8":
            raise ValueError("executor 'cpu-layers' reads an int8 KV cache but not an fp8 one; kv_cache_dtype "
                             "'fp8' needs executor 'xla' (or 'auto')")
        if attention_backend not in ("auto", "cpu"):
            raise ValueError(f"executor 'cpu-layers' runs its own attention (the C++ kernel); attention_backend "
                             f"{attention_backend!r} needs executor 'xla'")
        return CpuLayerExecutor, "cpu", why
    if executor != "xla":
        raise ValueError(f"unknown executor {executor!r}")
    if kv_cache_dtype == "fp8" and attention_backend == "cpu":
        raise ValueError("attention_backend 'cpu' (the C++ kernel) reads int8 pages but not fp8 ones; "
                         "kv_cache_dtype 'fp8' needs attention_backend 'reference' or 'auto'")
    if kv_cache_dtype == "fp8" and attention_backend == "auto" and platform == "cpu":
        return XlaExecutor, "reference", why
    return XlaExecutor, resolve_backend(attention_backend, platform), why


__all__ = ["CpuLayerExecutor", "Executor", "StepOutput", "WarmupReport", "XlaExecutor", "choose_executor"]
