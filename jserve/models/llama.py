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


# Where each of the layer kernel's weights sits in a DecoderLayer (None-valued where the model has no such weight); the
# loader stacks each across layers by these paths (checkpoints.host_arena.LayerStacks).
KERNEL_WEIGHT_PATHS = cpu_kernels.LayerWeights(
    input_norm=("input_layernorm", "weight"), qkv=("self_attn", "qkv_proj", "weight"),
    o=("self_attn", "o_proj", "weight"), post_norm=("post_attention_layernorm", "weight"),
    gate_up=("mlp", "gate_up_proj", "weight"), down=("mlp", "down_proj", "weight"),
    qkv_bias=("self_attn", "qkv_proj", "bias"), o_bias=("self_attn", "o_proj", "bias"),
    gate_up_bias=("mlp", "gate_up_proj", "bias"), down_bias=("mlp", "down_proj", "bias"),
    q_norm=("self_attn", "q_norm", "weight"), k_norm=("self_attn", "k_norm", "weight"))


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
        def value(path: tuple[str, ...]) -> jax.Array | None:
            node = self
            for name in path:
                node = getattr(node, name, None)
                if node is None:  # no bias, or no q/k norm
                    return None
            return node[...]

        # Every path but matrix_parts, the last field: a layer's own weights are never in parts.
        return cpu_kernels.LayerWeights(*(value(path) for path in KERNEL_WEIGHT_PATHS[:-1]))


def _kernel_layers(config: ModelConfig, weights: list[cpu_kernels.LayerWeights] | cpu_kernels.LayerWeights, x,
                   k_cache, v_cache, batch: StepBatch, inv_freq):
    """Every layer in one call of the layer kernel (no return to XLA between layers)."""
    return cpu_kernels.decoder_layers(
        x, weights, k_cache, v_cache, positions=batch.positions, slot_mapping=batch.slot_mapping,
        page_table=batch.page_table, query_start=batch.query_start, seq_lens=batch.seq_lens, inv_freq=inv_freq,
        num_heads=config.num_heads, eps=config.rms_norm_eps, scale=config.head_dim**-0.5,
        sliding_window=config.sliding_window, intermediate_size=config.intermediate_size)


class LlamaForCausalLM(nnx.Module):
    """forward(kv_cache, batch) -> (kv_cache, logits[S, V]) over a ragged batch and a paged KV cache."""

    kernel_weight_paths = KERNEL_WEIGHT_PATHS  # a layer's weights for the layer kernel, by path (the loader's stacks)

    def __init__(self, config: ModelConfig, dtype: jnp.dtype = jnp.float32, attention_backend: str = "reference"):
        self.config = config
        self.cpu_kernel = attention_backend == "cpu"
        self.embed_tokens = nnx.Param(jnp.zeros((config.vocab_size, config.hidden_size), dtype),
                                      logical_axes=("vocab", "embed"))
        self.layers = nnx.List([DecoderLayer(config, dtype, attention_backend) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else param(
            (config.vocab_size, config.hidden_size), dtype, ("vocab", "embed"))

    def __call__(self, kv_cache: KVCache, batch: StepBatch,
                 layer_stack: cpu_kernels.LayerWeights | None = None) -> tuple[KVCache, jax.Array]:
        """layer_stack: every layer's weights stacked (the loader's, aliasing the layers' own), for the layer kernel;
        given it, the layers' own weights are not read (the runner traces them as placeholders)."""
        inv_freq = rope_inv_freq(self.config)
        x = embed_lookup(self.embed_tokens[...], batch.token_ids)
        fused = self.layers[0].fused(x.shape[0])
        if layer_stack is not None:
            if not fused:
                raise ValueError(f"stacked layer weights need the layer kernel, which does not take this batch "
                                 f"({x.shape[0]} tokens, {self.layers[0].cpu_kernel=})")
            x, k_cache, v_cache = _kernel_layers(self.config, layer_stack, x, kv_cache.k, kv_cache.v, batch, inv_freq)
        elif self.layers and self.layers[0].self_attn.qkv_proj.weight[...].size == 0:
            raise ValueError("this model's layer matrices were loaded in per-thread parts for the CPU layer kernel "
                             "(checkpoints.loading.load_model's weight_parts): pass its LoadedModel.layer_stack")
        elif fused:  # the kernel takes the cache in either form
            weights = [layer.kernel_weights() for layer in self.layers]
            x, k_cache, v_cache = _kernel_layers(self.config, weights, x, kv_cache.k, kv_cache.v, batch, inv_freq)
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
