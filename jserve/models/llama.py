"""The Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3): one decoder whose differences are config flags.

Qwen2 adds q/k/v biases, Qwen3 normalizes q and k per head before rotary, Mistral may use a sliding window;
everything else is shared, so one module serves all four. q/k/v and gate/up projections are fused into one
matmul each (the checkpoint loader concatenates them) because small dots pay a fixed cost on XLA CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import cpu_kernels
from jserve.config import ModelConfig
from jserve.models.batch import KVCache, StepBatch
from jserve.models.layers import (
    Linear,
    RMSNorm,
    apply_rope,
    embed_lookup,
    matmul,
    param,
    rope_inv_freq,
    split_fused,
)
from pallas_kernels import ragged_paged_attention, write_kv
from sharding.kernels import model_parallel_mesh


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, dtype: jnp.dtype, attention_backend: str = "reference"):
        self.config = config
        self.attention_backend = attention_backend  # a static str in the graphdef: picks the kernel at trace time
        cpu_kernel = attention_backend == "cpu"  # the "cpu" backend also runs the matmuls in C++
        qkv_out = config.q_size + 2 * config.kv_size
        self.qkv_proj = Linear(config.hidden_size, qkv_out, dtype=dtype, axes=("qkv", "embed"), bias=config.qkv_bias,
                               cpu_kernel=cpu_kernel)
        self.o_proj = Linear(config.q_size, config.hidden_size, dtype=dtype, axes=("embed", "heads"),
                             bias=config.o_bias, cpu_kernel=cpu_kernel)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def __call__(self, x: jax.Array, k_pages: jax.Array, v_pages: jax.Array, batch: StepBatch,
                 inv_freq) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg = self.config
        num_tokens = x.shape[0]
        q, k, v = split_fused(self.qkv_proj(x), (cfg.q_size, cfg.kv_size, cfg.kv_size), cfg.fused_shards)
        q = q.reshape(num_tokens, cfg.num_heads, cfg.head_dim)
        k = k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, batch.positions, inv_freq)
        k = apply_rope(k, batch.positions, inv_freq)
        k_pages, v_pages = write_kv(k_pages, v_pages, k, v, batch.slot_mapping)
        out = ragged_paged_attention(q, k_pages, v_pages, batch.page_table, batch.query_start, batch.seq_lens,
                                     scale=cfg.head_dim**-0.5, sliding_window=cfg.sliding_window,
                                     backend=self.attention_backend)
        return self.o_proj(out.reshape(num_tokens, cfg.q_size)), k_pages, v_pages


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, dtype: jnp.dtype, cpu_kernel: bool = False):
        self.intermediate_size = config.intermediate_size
        self.fused_shards = config.fused_shards  # [gate | up] row blocks (see split_fused)
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, dtype=dtype,
                                   axes=("mlp", "embed"), bias=config.mlp_bias, cpu_kernel=cpu_kernel)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, dtype=dtype,
                                axes=("embed", "mlp"), bias=config.mlp_bias, cpu_kernel=cpu_kernel)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = split_fused(self.gate_up_proj(x), (self.intermediate_size,) * 2, self.fused_shards)
        return self.down_proj(jax.nn.silu(gate) * up)


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, dtype: jnp.dtype, attention_backend: str = "reference"):
        self.config = config
        self.cpu_kernel = attention_backend == "cpu"  # static: the whole layer may run as one C++ kernel
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, dtype, attention_backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, dtype, cpu_kernel=self.cpu_kernel)

    def __call__(self, x, k_pages, v_pages, batch, inv_freq):
        attn_out, k_pages, v_pages = self.self_attn(self.input_layernorm(x), k_pages, v_pages, batch, inv_freq)
        x = x + attn_out
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k_pages, v_pages

    def fused(self, num_tokens: int) -> bool:
        """The layer kernel takes this batch: on the cpu backend, unsharded, and for batches the kernels take (with
        AMX, XLA's dot runs the large ones: cpu_kernels.max_kernel_rows)."""
        return (self.cpu_kernel and model_parallel_mesh() is None and self.config.fused_shards == 1
                and num_tokens <= cpu_kernels.max_kernel_rows())

    def kernel_weights(self) -> cpu_kernels.LayerWeights:
        attn, mlp = self.self_attn, self.mlp
        value = lambda module: None if module is None else module[...]
        return cpu_kernels.LayerWeights(
            input_norm=self.input_layernorm.weight[...], qkv=attn.qkv_proj.weight[...], o=attn.o_proj.weight[...],
            post_norm=self.post_attention_layernorm.weight[...], gate_up=mlp.gate_up_proj.weight[...],
            down=mlp.down_proj.weight[...], qkv_bias=value(attn.qkv_proj.bias), o_bias=value(attn.o_proj.bias),
            gate_up_bias=value(mlp.gate_up_proj.bias), down_bias=value(mlp.down_proj.bias),
            q_norm=None if attn.q_norm is None else attn.q_norm.weight[...],
            k_norm=None if attn.k_norm is None else attn.k_norm.weight[...])


def _kernel_layers(layers: list[DecoderLayer], x, k_cache, v_cache, batch: StepBatch, inv_freq):
    """Every layer in one call of the layer kernel (no return to XLA between layers)."""
    cfg = layers[0].config
    return cpu_kernels.decoder_layers(
        x, [layer.kernel_weights() for layer in layers], k_cache, v_cache, positions=batch.positions,
        slot_mapping=batch.slot_mapping, page_table=batch.page_table, query_start=batch.query_start,
        seq_lens=batch.seq_lens, inv_freq=inv_freq, num_heads=cfg.num_heads, eps=cfg.rms_norm_eps,
        scale=cfg.head_dim**-0.5, sliding_window=cfg.sliding_window)


class LlamaForCausalLM(nnx.Module):
    """forward(kv_cache, batch) -> (kv_cache, logits[S, V]) over a ragged batch and a paged KV cache."""

    def __init__(self, config: ModelConfig, dtype: jnp.dtype = jnp.float32, attention_backend: str = "reference"):
        self.config = config
        self.cpu_kernel = attention_backend == "cpu"
        self.embed_tokens = nnx.Param(jnp.zeros((config.vocab_size, config.hidden_size), dtype),
                                      logical_axes=("vocab", "embed"))
        self.layers = nnx.List([DecoderLayer(config, dtype, attention_backend) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else param(
            (config.vocab_size, config.hidden_size), dtype, ("vocab", "embed"))

    def __call__(self, kv_cache: KVCache, batch: StepBatch) -> tuple[KVCache, jax.Array]:
        inv_freq = rope_inv_freq(self.config)
        x = embed_lookup(self.embed_tokens[...], batch.token_ids)
        if self.layers[0].fused(x.shape[0]):  # the kernel takes the cache in either form
            x, k_cache, v_cache = _kernel_layers(list(self.layers), x, kv_cache.k, kv_cache.v, batch, inv_freq)
        else:  # a stacked cache is split into layers and stacked again (correct, but copies: runners avoid it)
            k_cache, v_cache = list(kv_cache.k), list(kv_cache.v)
            for i, layer in enumerate(self.layers):
                x, k_cache[i], v_cache[i] = layer(x, k_cache[i], v_cache[i], batch, inv_freq)
            if kv_cache.stacked:
                k_cache, v_cache = jnp.stack(k_cache), jnp.stack(v_cache)
        last = self.norm(x[batch.logits_indices])  # only the positions that produce a next token
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        logits = matmul(last, head[...], self.cpu_kernel, self.config.vocab_size)
        return KVCache(k=k_cache, v=v_cache), logits
