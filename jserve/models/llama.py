"""The Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Phi-3, Granite, Gemma 1/2/3, SmolLM3, OLMo 2/3, GLM-4, and
the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5, OLMoE, gpt-oss, DeepSeek-V2/V3, Granite MoE and
Llama 4): one decoder whose differences are config flags.

Qwen2 adds q/k/v biases, Qwen3 normalizes q and k per head before rotary, Mistral may use a sliding window; Gemma
scales its embeddings, uses GELU, windows some layers and not others (Gemma 3 rotating them with their own base),
soft-caps scores and logits (Gemma 2) and normalizes each block's output too (Gemma 2/3); SmolLM3 leaves rotary
embedding out of every fourth layer; OLMo normalizes q and k over all heads at once, OLMo 2/3 each block's output
instead of its input; gpt-oss adds attention sinks; DeepSeek attends through a latent (jserve.models.mla); the MoE
families' MLP is a mixture of experts (jserve.models.moe). Everything else is shared, so one module serves them all
(Phi-3's, Granite's and GLM-4's differences are folded into the weights at load). q/k/v and gate/up projections are
fused into one matmul each (the checkpoint loader concatenates them) because small dots pay a fixed cost on XLA CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import cpu_kernels
from jserve.config import ModelConfig
from jserve.models.batch import KVCache, StepBatch
from jserve.models.layers import (
    Linear,
    RMSNorm,
    apply_rope,
    embed_lookup,
    embedding_multiplier,
    matmul,
    mlp_activation,
    param,
    rope_inv_freq,
    soft_cap,
    split_fused,
)
from jserve.models.mla import LatentAttention
from jserve.models.moe import SparseMoeBlock
from jserve.models.quantization import quantized_matmul
from pallas_kernels import ragged_paged_attention, write_kv


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, dtype: jnp.dtype, attention_backend: str = "reference", layer: int = 0):
        self.config = config
        self.attention_backend = attention_backend  # a static str in the graphdef: picks the kernel at trace time
        self.sliding_window = config.layer_window(layer)  # static too, like the local rotary choice
        self.attention_chunk = config.layer_attention_chunk(layer)  # Llama 4's chunked layers
        self.rotary = config.layer_rotary(layer)  # static: 0 rope_theta's, 1 the local base's, 2 none (NoPE)
        qkv_out = config.q_size + 2 * config.kv_size
        self.qkv_proj = Linear(config.hidden_size, qkv_out, dtype=dtype, axes=("qkv", "embed"), bias=config.qkv_bias,
                               lora=config.lora_shape(3))
        self.o_proj = Linear(config.q_size, config.hidden_size, dtype=dtype, axes=("embed", "heads"),
                             bias=config.o_bias, lora=config.lora_shape(1))
        if config.qk_norm or config.qk_norm_across_heads:  # per head, or over all heads at once (OLMo)
            across = config.qk_norm_across_heads
            q_width, k_width = (config.q_size, config.kv_size) if across else (config.head_dim, config.head_dim)
            self.q_norm = RMSNorm(q_width, config.rms_norm_eps)
            self.k_norm = RMSNorm(k_width, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # gpt-oss: one learned logit per query head that joins its softmax's denominator
        self.sinks = param((config.num_heads,), jnp.float32, ("heads",)) if config.attention_sinks else None

    def __call__(self, x: jax.Array, k_pages: jax.Array, v_pages: jax.Array, batch: StepBatch,
                 inv_freq: tuple[np.ndarray, np.ndarray], lora_slots: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg = self.config
        num_tokens = x.shape[0]
        q, k, v = split_fused(self.qkv_proj(x, lora_slots), (cfg.q_size, cfg.kv_size, cfg.kv_size), cfg.fused_shards)
        if cfg.qk_norm_across_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        if cfg.clip_qkv is not None:
            q, k, v = (jnp.clip(t, -cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
        q = q.reshape(num_tokens, cfg.num_heads, cfg.head_dim)
        k = k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary < 2:  # (global, local) frequencies; a NoPE layer sees no positions
            q = apply_rope(q, batch.positions, inv_freq[self.rotary])
            k = apply_rope(k, batch.positions, inv_freq[self.rotary])
            if cfg.qk_l2_norm:  # Llama 4: each head's q and k normalized after rotary, no weight
                q, k = l2_norm(q, cfg.rms_norm_eps), l2_norm(k, cfg.rms_norm_eps)
        elif cfg.attention_temperature is not None:  # Llama 4's NoPE layers: queries sharpened with the position
            floor_scale, attn_scale = cfg.attention_temperature
            positions = batch.positions.astype(jnp.float32)
            scale = jnp.log1p(jnp.floor((positions + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q * scale[:, None, None]).astype(q.dtype)
        k_pages, v_pages = write_kv(k_pages, v_pages, k, v, batch.slot_mapping)
        out = ragged_paged_attention(q, k_pages, v_pages, batch.page_table, batch.query_start, batch.seq_lens,
                                     scale=cfg.attention_scale, sliding_window=self.sliding_window,
                                     soft_cap=cfg.attn_logit_softcapping,
                                     sinks=None if self.sinks is None else self.sinks[...],
                                     backend=self.attention_backend, attention_chunk=self.attention_chunk)
        return self.o_proj(out.reshape(num_tokens, cfg.q_size), lora_slots), k_pages, v_pages


def l2_norm(x: jax.Array, eps: float) -> jax.Array:
    """x scaled to unit root-mean-square over its last axis (an RMSNorm without weight), in float32."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, dtype: jnp.dtype, intermediate_size: int | None = None):
        self.intermediate_size = intermediate_size or config.intermediate_size  # a shared expert's own width
        self.hidden_act = config.hidden_act
        self.fused_shards = config.fused_shards  # [gate | up] row blocks (see split_fused)
        lora = intermediate_size is None  # adapters adapt the decoder's MLP, not a shared expert
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate_size, dtype=dtype,
                                   axes=("mlp", "embed"), bias=config.mlp_bias,
                                   lora=config.lora_shape(2) if lora else None)
        self.down_proj = Linear(self.intermediate_size, config.hidden_size, dtype=dtype,
                                axes=("embed", "mlp"), bias=config.mlp_bias,
                                lora=config.lora_shape(1) if lora else None)

    def __call__(self, x: jax.Array, lora_slots: jax.Array | None = None) -> jax.Array:
        gate, up = split_fused(self.gate_up_proj(x, lora_slots), (self.intermediate_size,) * 2, self.fused_shards)
        return self.down_proj(mlp_activation(gate, self.hidden_act) * up, lora_slots)


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, dtype: jnp.dtype, attention_backend: str = "reference", layer: int = 0):
        norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps)  # noqa: E731
        # OLMo 2 normalizes each block's output only; the other families normalize its input.
        self.input_layernorm = None if config.post_norms else norm()
        self.self_attn = (LatentAttention(config, dtype, attention_backend) if config.kv_lora_rank
                          else Attention(config, dtype, attention_backend, layer))
        # Llama's post_attention_layernorm is the MLP's input norm; with Gemma 2/3's sandwich norms and OLMo 2's post
        # norms it normalizes the attention output, and post_feedforward_layernorm the MLP's (Gemma's
        # pre_feedforward_layernorm its input).
        self.post_attention_layernorm = norm()
        # Mixtral / Qwen-MoE: a mixture of experts (Mixtral's block_sparse_moe is read under this name too)
        self.mlp = SparseMoeBlock(config, dtype, MLP) if config.layer_moe(layer) else MLP(config, dtype)
        self.pre_feedforward_layernorm = norm() if config.sandwich_norms else None
        self.post_feedforward_layernorm = norm() if config.sandwich_norms or config.post_norms else None

    def __call__(self, x, k_pages, v_pages, batch, inv_freq, lora_slots=None):
        h = x if self.input_layernorm is None else self.input_layernorm(x)
        attn_out, k_pages, v_pages = self.self_attn(h, k_pages, v_pages, batch, inv_freq, lora_slots)
        if isinstance(self.mlp, SparseMoeBlock):  # padding tokens (after the batch's last) reach no expert
            real = jnp.arange(x.shape[0]) < batch.query_start[-1]
            mlp = lambda h: self.mlp(h, real)  # noqa: E731
        else:
            mlp = lambda h: self.mlp(h, lora_slots)  # noqa: E731
        if self.post_feedforward_layernorm is None:
            x = x + attn_out
            x = x + mlp(self.post_attention_layernorm(x))
        else:
            x = x + self.post_attention_layernorm(attn_out)
            h = x if self.pre_feedforward_layernorm is None else self.pre_feedforward_layernorm(x)
            x = x + self.post_feedforward_layernorm(mlp(h))
        return x, k_pages, v_pages


class LlamaForCausalLM(nnx.Module):
    """forward(kv_cache, batch) -> (kv_cache, logits[S, V]) over a ragged batch and a paged KV cache."""

    def __init__(self, config: ModelConfig, dtype: jnp.dtype = jnp.float32, attention_backend: str = "reference"):
        self.config = config
        self.embed_tokens = nnx.Param(jnp.zeros((config.vocab_size, config.hidden_size), dtype),
                                      logical_axes=("vocab", "embed"))
        self.layers = nnx.List([DecoderLayer(config, dtype, attention_backend, i) for i in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else param(
            (config.vocab_size, config.hidden_size), dtype, ("vocab", "embed"))
        # Set by jserve.models.quantization where the LM head is quantized: its per-row float32 scales, and the
        # float dtype its weight is converted to inside the dot.
        self.head_scale: nnx.Param | None = nnx.data(None)
        self.head_compute_dtype = jnp.dtype(dtype)
        self.embedding_multiplier = embedding_multiplier(config, dtype)

    def __call__(self, kv_cache: KVCache, batch: StepBatch) -> tuple[KVCache, jax.Array]:
        inv_freq = (rope_inv_freq(self.config), rope_inv_freq(self.config, local=True))
        tied_scale = self.head_scale[...] if self.head_scale is not None and self.lm_head is None else None
        x = embed_lookup(self.embed_tokens[...], batch.token_ids, tied_scale)
        if self.embedding_multiplier != 1.0:  # Granite, Gemma
            x = x * self.embedding_multiplier
        k_cache, v_cache = list(kv_cache.k), list(kv_cache.v)
        # each token's adapter slot (LoRA engines only: their batches carry each sequence row's)
        lora_slots = None if batch.lora_slots is None else batch.lora_slots[batch.token_seq]
        for i, layer in enumerate(self.layers):
            x, k_cache[i], v_cache[i] = layer(x, k_cache[i], v_cache[i], batch, inv_freq, lora_slots)
        return KVCache(k=k_cache, v=v_cache), self.logits(x[batch.logits_indices])

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits [S, V] of the final hidden states [S, E] (only the positions that predict a token); for
        an embedding model (config.pooling) the normalized hidden states themselves [S, E]."""
        if self.config.pooling:
            return self.norm(hidden).astype(jnp.float32)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        if cpu_kernels.is_packed(head[...]):  # packed by the CPU layer executor (int8: with its scales)
            logits = cpu_kernels.matmul(self.norm(hidden), head[...], self.config.vocab_size, self.head_compute_dtype)
        elif self.head_scale is not None:
            logits = quantized_matmul(self.norm(hidden), head[...], self.head_scale[...], self.head_compute_dtype)
        else:
            logits = matmul(self.norm(hidden), head[...])
        return soft_cap(logits, self.config.final_logit_softcapping)
