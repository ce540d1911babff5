"""Building blocks shared by the Llama-family decoders: linear, RMSNorm, rotary embedding.

Every weight is declared once with its shape, dtype and logical axes (the sharding rules map those names to
mesh axes). Matmuls keep Hugging Face's [out, in] layout and contract the last axis of both operands with a
float32 result: on XLA CPU that is the fast path for bfloat16 weights (see docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import cpu_kernels
from jserve.config import ModelConfig
from jserve.config_json import GEMMA_TYPES, RopeScaling
from jserve.models.quantization import quantized_matmul
from pallas_kernels.reference import dot_precision


def param(shape: tuple[int, ...], dtype: jnp.dtype, axes: tuple[str | None, ...]) -> nnx.Param:
    """A parameter filled with zeros: real values always come from a checkpoint."""
    assert len(shape) == len(axes), (shape, axes)
    return nnx.Param(jnp.zeros(shape, dtype), logical_axes=axes)


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x[..., in] @ w[out, in]^T -> float32[..., out]."""
    return jax.lax.dot_general(x.astype(w.dtype), w, (((x.ndim - 1,), (1,)), ((), ())),
                               precision=dot_precision(w.dtype), preferred_element_type=jnp.float32)


def embed_lookup(table: jax.Array, token_ids: jax.Array, scale: jax.Array | None = None) -> jax.Array:
    """Rows of the embedding table as float32 (times their rows' scales where the table is quantized). A bfloat16
    table is gathered as uint16 bits: XLA CPU would otherwise convert the whole table to float32 on every step."""
    if cpu_kernels.is_packed(table):  # the CPU layer executor's tied table, packed for its LM head (int8: scaled)
        return cpu_kernels.packed_rows(table, token_ids)
    if scale is not None:
        return table[token_ids].astype(jnp.float32) * scale[token_ids][:, None]
    if table.dtype != jnp.bfloat16:
        return table[token_ids].astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(table, jnp.uint16)[token_ids]
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16).astype(jnp.float32)


def split_fused(y: jax.Array, sizes: tuple[int, ...], blocks: int) -> list[jax.Array]:
    """Split the output of a fused projection into its parts (e.g. q, k, v).

    The fused rows are `blocks` equal row blocks, each holding its share of every part in order
    ([q_0 | k_0 | v_0 | q_1 | k_1 | v_1 ...]): with tensor parallelism each block is one device's own heads (see
    jserve.models.sharded_config). One block is the plain [q | k | v] layout, split exactly as before.
    """
    if blocks == 1:
        return jnp.split(y, np.cumsum(sizes)[:-1].tolist(), axis=-1)
    lead = y.shape[:-1]
    parts = jnp.split(y.reshape(*lead, blocks, -1), np.cumsum([s // blocks for s in sizes])[:-1].tolist(), axis=-1)
    return [p.reshape(*lead, size) for p, size in zip(parts, sizes, strict=True)]


class LoraWeight(nnx.Variable):
    """A LoRA adapter stack (jserve.lora): not read from the checkpoint; the executor writes adapters into its slots."""


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array) -> jax.Array:
    """float32[T, out]: each token's adapter's (x A^T) B^T, a: [L, R, in], b: [L, out, R], slots: i32[T] the slot
    of each token's adapter (-1, or any index outside [0, L): none). Every slot's x A^T is computed (R is small)
    and all but the token's own masked out, so the step keeps one shape whatever adapters the batch holds."""
    mask = jax.nn.one_hot(slots, a.shape[0], dtype=jnp.float32)  # [T, L]; all zeros outside [0, L)
    xa = jnp.einsum("ti,lri->tlr", x.astype(jnp.float32), a, precision=jax.lax.Precision.HIGHEST)
    return jnp.einsum("tlr,lor->to", xa * mask[:, :, None], b, precision=jax.lax.Precision.HIGHEST)


class Linear(nnx.Module):
    quantizable = True  # jserve.models.quantization.quantize_model turns it into an int8 / fp8 matmul

    def __init__(self, in_features: int, out_features: int, *, dtype: jnp.dtype, axes: tuple[str, str],
                 bias: bool = False, lora: tuple[int, int] | None = None):
        """lora: (max_loras, rank width) where the model serves LoRA adapters on this projection."""
        self.weight = param((out_features, in_features), dtype, axes)
        self.bias = param((out_features,), jnp.float32, axes[:1]) if bias else None
        if lora is None:
            self.lora_a = self.lora_b = nnx.data(None)
        else:
            slots, width = lora
            self.lora_a = LoraWeight(jnp.zeros((slots, width, in_features), jnp.float32),
                                     logical_axes=(None, None, axes[1]))
            self.lora_b = LoraWeight(jnp.zeros((slots, out_features, width), jnp.float32),
                                     logical_axes=(None, axes[0], None))
        # Set by jserve.models.quantization on a quantized Linear: per-output-row float32 scales of an int8 / fp8
        # weight, and the float dtype the weight is converted to inside the dot.
        self.scale: nnx.Param | None = nnx.data(None)
        self.compute_dtype = jnp.dtype(dtype)
        self.out_features = out_features

    def __call__(self, x: jax.Array, lora_slots: jax.Array | None = None) -> jax.Array:
        w = self.weight[...]
        if cpu_kernels.is_packed(w):  # packed by the CPU layer executor (an int8 one holds its scales)
            y = cpu_kernels.matmul(x, w, self.out_features, self.compute_dtype)
        elif self.scale is not None:
            y = quantized_matmul(x, w, self.scale[...], self.compute_dtype)
        else:
            y = matmul(x, w)
        if self.lora_a is not None and lora_slots is not None:
            y = y + lora_delta(x, self.lora_a[...], self.lora_b[...], lora_slots)
        return y if self.bias is None else y + self.bias[...]


class RMSNorm(nnx.Module):
    def __init__(self, size: int, eps: float, axis_name: str = "norm"):
        self.weight = param((size,), jnp.float32, (axis_name,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x = x.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * weight


def embedding_multiplier(config: ModelConfig, dtype: jnp.dtype) -> float:
    """What the input embeddings are multiplied by: Granite's multiplier, or Gemma's sqrt(hidden_size) rounded to
    the model's dtype (as transformers and Gemma's own code multiply, in that dtype)."""
    if config.model_type in GEMMA_TYPES:
        return float(np.asarray(config.embedding_multiplier, np.dtype(dtype)))  # numpy: also under a trace
    return config.embedding_multiplier


def mlp_activation(x: jax.Array, name: str) -> jax.Array:
    """The gate's activation of a SwiGLU / GeGLU MLP (config_json.ACTIVATIONS): SiLU, or GELU's tanh form."""
    return jax.nn.silu(x) if name == "silu" else jax.nn.gelu(x, approximate=True)


def soft_cap(logits: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(logits / cap) (Gemma 2's final logits), or the logits where there is no cap."""
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def rope_inv_freq(config: ModelConfig, local: bool = False) -> np.ndarray:
    """Inverse rotary frequencies [head_dim / 2], computed as transformers does (float32), with linear / llama3 /
    longrope scaling, or divided by per-frequency factors (llama.cpp's rope_freqs, as GGUF files store llama3
    scaling). Under partial rotary embedding the frequencies of the rotated pairs are followed by zeros: the
    passed-through pairs turn by angle 0 (cos 1, sin 0), which leaves them exactly as they are. local: those of
    the windowed layers that rotate by local_rope_theta, unscaled (Gemma 3; rope_theta's where it is None)."""
    if local and config.local_rope_theta is not None:
        config = dataclasses.replace(config, rope_theta=config.local_rope_theta, rope_scaling=RopeScaling())
    inv_freq = _rotary_inv_freq(config)
    return np.pad(inv_freq, (0, config.head_dim // 2 - len(inv_freq)))


def _rotary_inv_freq(config: ModelConfig) -> np.ndarray:
    dim = config.rotary_dims
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    scaling = config.rope_scaling
    if scaling.kind == "longrope":
        factors = scaling.long_factors if scaling.use_long_factors else scaling.short_factors
        return (1.0 / (np.asarray(factors, np.float32) * np.float32(config.rope_theta) ** exponents)).astype(
            np.float32)
    inv_freq = (1.0 / (np.float32(config.rope_theta) ** exponents)).astype(np.float32)
    if scaling.kind == "linear":
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    if scaling.kind == "freq_factors":
        return (inv_freq / np.asarray(scaling.freq_factors, np.float32)).astype(np.float32)
    if scaling.kind == "yarn":
        return _yarn_inv_freq(np.float32(config.rope_theta) ** exponents, dim, config.rope_theta, scaling)
    if scaling.kind == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(is_medium, smoothed, scaled).astype(np.float32)
    return inv_freq


def _yarn_inv_freq(pos_freqs: np.ndarray, dim: int, base: float, scaling) -> np.ndarray:
    """YaRN's frequencies (transformers' _compute_yarn_parameters, in float32 as it computes them): the rotary
    dimensions whose pairs turn more than beta_fast times over the original context keep their frequency, those
    turning fewer than beta_slow times take it divided by factor, and a linear ramp over the dimensions between
    mixes the two."""
    def dimension(rotations: float) -> float:  # the dimension whose pair turns `rotations` times over the context
        turns = scaling.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(turns) / (2 * math.log(base))

    low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (1 - ramp).astype(np.float32)  # the share of each frequency's own (extrapolated) value
    own = (1.0 / pos_freqs).astype(np.float32)
    interpolated = (1.0 / (np.float32(scaling.factor) * pos_freqs)).astype(np.float32)
    return (interpolated * (1 - keep) + own * keep).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate x[T, heads, head_dim] by positions[T] (the rotate-half convention of Llama checkpoints)."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, D/2]
    cos = jnp.cos(freqs)[:, None, :]
    sin = jnp.sin(freqs)[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
