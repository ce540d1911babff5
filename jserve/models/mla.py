"""DeepSeek-V2/V3's multi-head latent attention, computed in the latent space.

A token's keys and values are one latent vector c (kv_lora_rank wide: kv_a_proj_with_mqa, then kv_a_layernorm)
and one rotary key k_rope (qk_rope_head_dim) that every head shares; head h's key is [W_k[h] c | k_rope] and its
value W_v[h] c, with W_k and W_v the two halves of each head's rows of kv_b_proj. Since q . W_k c = (W_k^T q) . c,
each head's query is taken into the latent space once ([W_k[h]^T q_nope | q_rope]) and attends to the cached
[c | k_rope] directly: the cache holds one KV head of kv_lora_rank + qk_rope_head_dim per token, whatever the
number of heads (DeepSeek's "absorbed" form; vLLM and SGLang serve it so), and any attention backend computes it
as multi-query attention. Its output's first kv_lora_rank dimensions are the attention-weighted latent, which
W_v[h] takes to the head's value space before o_proj. Attention reads its values from the key pages: the engine's
cache has no value pages for these layers (ModelConfig.values_in_key_pages).

The rotary pairs are laid out as halves at load (checkpoints.deepseek), and YaRN's attention factor is folded
into the rotary rows of the query and key projections there, as for the other families.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jserve.config import ModelConfig
from jserve.models.batch import StepBatch
from jserve.models.layers import Linear, RMSNorm, apply_rope, param, rope_inv_freq
from pallas_kernels import ragged_paged_attention, write_kv
from pallas_kernels.reference import dot_precision


class LatentProjection(nnx.Module):
    """kv_b_proj: each head's key rows (qk_nope_head_dim) then value rows (v_head_dim) over the latent, as
    Hugging Face stores them ([heads x (nope + v), kv_lora_rank]). It is multiplied head by head, not as one
    matmul, so it stays in float under weight quantization."""

    def __init__(self, config: ModelConfig, dtype: jnp.dtype):
        rows = config.num_heads * (config.qk_nope_head_dim + config.v_head_dim)
        self.weight = param((rows, config.kv_lora_rank), dtype, ("qkv", None))

    def heads(self, num_heads: int, nope: int) -> tuple[jax.Array, jax.Array]:
        """(W_k [heads, nope, rank], W_v [heads, v, rank])."""
        w = self.weight[...]
        w = w.reshape(num_heads, -1, w.shape[-1])
        return w[:, :nope], w[:, nope:]


class LatentAttention(nnx.Module):
    def __init__(self, config: ModelConfig, dtype: jnp.dtype, attention_backend: str = "reference"):
        self.config = config
        self.attention_backend = attention_backend
        heads, rank, rope = config.num_heads, config.kv_lora_rank, config.qk_rope_head_dim
        q_width = heads * (config.qk_nope_head_dim + rope)
        if config.q_lora_rank:
            self.q_a_proj = Linear(config.hidden_size, config.q_lora_rank, dtype=dtype, axes=(None, "embed"),
                                   bias=config.qkv_bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = Linear(config.q_lora_rank, q_width, dtype=dtype, axes=("qkv", None))
            self.q_proj = None
        else:
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
            self.q_proj = Linear(config.hidden_size, q_width, dtype=dtype, axes=("qkv", "embed"))
        self.kv_a_proj_with_mqa = Linear(config.hidden_size, rank + rope, dtype=dtype, axes=(None, "embed"),
                                         bias=config.qkv_bias)
        self.kv_a_layernorm = RMSNorm(rank, config.rms_norm_eps)
        self.kv_b_proj = LatentProjection(config, dtype)
        self.o_proj = Linear(heads * config.v_head_dim, config.hidden_size, dtype=dtype, axes=("embed", "heads"),
                             bias=config.o_bias)

    def __call__(self, x: jax.Array, k_pages: jax.Array, v_pages: jax.Array | None, batch: StepBatch,
                 inv_freq: tuple[np.ndarray, np.ndarray] | None = None, lora_slots: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """(output, key pages, value pages) as Attention's; v_pages None: the engine's cache keeps no value pages
        (ModelConfig.values_in_key_pages), and the latent is read from the key pages as both."""
        cfg = self.config
        num_tokens, heads = x.shape[0], cfg.num_heads
        nope, rank = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        if self.q_proj is None:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        # the rotary key's frequencies: rope_theta and its scaling over qk_rope_head_dim (a constant of the trace)
        rotary = rope_inv_freq(dataclasses.replace(cfg, head_dim=cfg.qk_rope_head_dim, rotary_dim=None))
        q = q.reshape(num_tokens, heads, -1)
        q_nope, q_rope = q[..., :nope], apply_rope(q[..., nope:], batch.positions, rotary)
        latent = self.kv_a_proj_with_mqa(x)
        c = self.kv_a_layernorm(latent[:, :rank])
        k_rope = apply_rope(latent[:, None, rank:], batch.positions, rotary)[:, 0]
        w_k, w_v = self.kv_b_proj.heads(heads, nope)
        # Head by head in the weights' dtype: XLA CPU has no batched bfloat16 dot into float32, and the products are
        # rounded to the cache's dtype (the query) or o_proj's (the values) next anyway.
        q_latent = jnp.einsum("thn,hnr->thr", q_nope.astype(w_k.dtype), w_k, precision=dot_precision(w_k.dtype))
        query = jnp.concatenate([q_latent.astype(jnp.float32), q_rope], axis=-1)
        # one KV head, repeated where tensor parallelism keeps a copy on every device (kv_head_replicas)
        kv = jnp.broadcast_to(jnp.concatenate([c, k_rope], axis=-1)[:, None, :],
                              (num_tokens, cfg.num_kv_heads, cfg.head_dim))
        k_pages, v_pages = write_kv(k_pages, v_pages, kv, None if v_pages is None else kv, batch.slot_mapping)
        values_pages = k_pages if v_pages is None else v_pages  # the latent is both (no value pages of its own)
        out = ragged_paged_attention(query, k_pages, values_pages, batch.page_table, batch.query_start,
                                     batch.seq_lens, scale=cfg.attention_scale, backend=self.attention_backend)
        values = jnp.einsum("thr,hvr->thv", out[..., :rank].astype(w_v.dtype), w_v, precision=dot_precision(w_v.dtype))
        return self.o_proj(values.reshape(num_tokens, heads * cfg.v_head_dim), lora_slots), k_pages, v_pages
