"""Ragged paged attention: one interface (interface.py, with its spec), a pure-JAX reference that defines
correctness and a chunked pure-JAX attention for the engine (reference.py), a Pallas Mosaic kernel for TPU (tpu.py)
and a Pallas Triton kernel for GPU (gpu.py); each also reads quantized KV pages (quantized.py: int8 or e4m3 values
with one float32 scale per token and KV head)."""

from pallas_kernels.gpu import ragged_paged_attention_gpu
from pallas_kernels.interface import (
    BACKENDS,
    ENGINE_BACKENDS,
    ragged_paged_attention,
    resolve_backend,
    token_positions,
    write_kv,
)
from pallas_kernels.quantized import KV_CACHE_DTYPES, QuantizedPages
from pallas_kernels.reference import ragged_paged_attention_chunked, ragged_paged_attention_ref, write_kv_ref
from pallas_kernels.tpu import ragged_paged_attention_tpu

__all__ = ["BACKENDS", "ENGINE_BACKENDS", "KV_CACHE_DTYPES", "QuantizedPages", "ragged_paged_attention",
           "ragged_paged_attention_chunked", "ragged_paged_attention_gpu", "ragged_paged_attention_ref",
           "ragged_paged_attention_tpu", "resolve_backend", "token_positions", "write_kv", "write_kv_ref"]
