"""Quantized KV pages: int8 or float8_e4m3fn values with one float32 scale per (token, KV head).

A quantized layer cache is a `QuantizedPages` pytree in place of the [N, B, Hkv, D] array:

  values  [N, B, Hkv, D]  int8, or float8_e4m3fn (stored as its uint8 bits on CPU, see kv_value_storage)
  scales  [N, B, Hkv]     float32: value = stored * scale
  dtype                   static: the dtype attention computes in (the model's), as for an unquantized cache

The scale of a (token, KV head) row is max|row| / qmax (127 for int8, 448 for e4m3), computed from that row alone
when it is written, so a write never touches another token's data and a prefix-cached page never changes. Per row
the scale factors out of both attention products: q.k = scale_k * (q . k_stored), and sum_l p_l v_l =
sum_l (p_l * scale_v,l) v_stored,l. So every backend converts the stored values to its compute dtype (exact: int8
and e4m3 values are bfloat16 numbers) and applies the scales to the [rows, keys] score and probability tiles,
never to K or V: no float copy of a page, let alone the cache, is ever built.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # "auto": the model's dtype, unquantized
_QUANTIZED = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn)}
_QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}
SCALE_DTYPE = jnp.dtype(jnp.float32)


@dataclass(frozen=True)
class QuantizedPages:
    """One layer's quantized K (or V) cache; see the module docstring for the layout."""

    values: jax.Array
    scales: jax.Array
    dtype: str  # static: the compute dtype's name ("float32" or "bfloat16")

    @property
    def quant_dtype(self) -> jnp.dtype:
        """The quantized element type (float8_e4m3fn for uint8 storage)."""
        return jnp.dtype(jnp.float8_e4m3fn) if self.values.dtype == jnp.uint8 else jnp.dtype(self.values.dtype)


jax.tree_util.register_dataclass(QuantizedPages, data_fields=["values", "scales"], meta_fields=["dtype"])


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")


def kv_quant_dtype(kv_cache_dtype: str) -> jnp.dtype | None:
    """The quantized element type of a kv_cache_dtype setting; None for "auto" (unquantized)."""
    check_kv_cache_dtype(kv_cache_dtype)
    return _QUANTIZED.get(kv_cache_dtype)


def kv_value_storage(quant_dtype: jnp.dtype, platform: str) -> jnp.dtype:
    """The values array's dtype: on CPU e4m3 is stored as its uint8 bits, because XLA CPU gathers and scatters
    float8 by converting the whole cache to float16 first (a full copy per layer per step); int8 as it is."""
    quant_dtype = jnp.dtype(quant_dtype)
    return jnp.dtype(jnp.uint8) if quant_dtype == jnp.float8_e4m3fn and platform == "cpu" else quant_dtype


def kv_bytes_per_token_head(head_dim: int, dtype: str | jnp.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes one token's K (or V) row of one KV head takes in the cache, its scale included."""
    quant = kv_quant_dtype(kv_cache_dtype)
    if quant is None:
        return head_dim * jnp.dtype(dtype).itemsize
    return head_dim * quant.itemsize + SCALE_DTYPE.itemsize


def zeros_pages(shape: tuple[int, ...], dtype: str | jnp.dtype, kv_cache_dtype: str, platform: str,
                zeros=jnp.zeros) -> QuantizedPages:
    """An empty quantized cache of `shape` (..., N, B, Hkv, D); zeros(shape, dtype) makes each array."""
    storage = kv_value_storage(kv_quant_dtype(kv_cache_dtype), platform)
    return QuantizedPages(values=zeros(shape, storage), scales=zeros(shape[:-1], SCALE_DTYPE),
                          dtype=jnp.dtype(dtype).name)


def quantize_rows(x: jax.Array, quant_dtype: jnp.dtype, storage: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (stored values [..., D], float32 scales [...]): symmetric, scale = max|row| / qmax; an all-zero
    row gets scale 0 (and zero values)."""
    quant_dtype = jnp.dtype(quant_dtype)
    qmax = _QMAX[quant_dtype]
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / qmax
    scaled = x / jnp.where(scale == 0, 1.0, scale)[..., None]
    if quant_dtype == jnp.int8:
        values = jnp.clip(jnp.round(scaled), -qmax, qmax).astype(jnp.int8)
    else:
        values = jnp.clip(scaled, -qmax, qmax).astype(quant_dtype)
        if storage == jnp.uint8:
            values = jax.lax.bitcast_convert_type(values, jnp.uint8)
    return values, scale


def stored_to_compute(values: jax.Array, dtype: str | jnp.dtype) -> jax.Array:
    """Gathered stored values (int8, float8 or float8's uint8 bits) in the compute dtype, without the scales."""
    if values.dtype == jnp.uint8:
        values = jax.lax.bitcast_convert_type(values, jnp.float8_e4m3fn)
    return values.astype(dtype)


def dequantize(pages: QuantizedPages) -> jax.Array:
    """The float32 values a quantized cache holds (tests and checks only: the engine never builds this)."""
    return stored_to_compute(pages.values, jnp.float32) * pages.scales[..., None]


def write_quantized(pages: QuantizedPages, new: jax.Array, slot_mapping: jax.Array) -> QuantizedPages:
    """Quantize new rows [T, Hkv, D] and scatter them, with their scales, into flat slots (page * B + offset);
    out-of-range slots (padding tokens) are dropped. One scatter per array, in place under donation."""
    num_pages, page_size, kv_heads, head_dim = pages.values.shape
    values, scales = quantize_rows(new, pages.quant_dtype, pages.values.dtype)
    flat_values = pages.values.reshape(num_pages * page_size, kv_heads, head_dim)
    flat_scales = pages.scales.reshape(num_pages * page_size, kv_heads)
    flat_values = flat_values.at[slot_mapping].set(values, mode="drop")
    flat_scales = flat_scales.at[slot_mapping].set(scales, mode="drop")
    return QuantizedPages(values=flat_values.reshape(pages.values.shape),
                          scales=flat_scales.reshape(pages.scales.shape), dtype=pages.dtype)
