"""The CPU layer executor: every decoder layer of a step in one call of the C++ layer kernel (cpu_kernels).

XLA's CPU backend runs a decode step's small matmuls far below memory bandwidth with a fixed cost per op, and its
paged attention must gather every page first; the layer kernel streams each weight once per step and reads pages in
place. This executor owns what that kernel needs: weights packed once at load (cpu_kernels.pack_weight), parameters
on huge pages (host_arena), each kind of layer weight stacked across layers or laid out in per-thread parts, a
stacked KV cache (two arrays a step instead of two a layer), lone decodes unpadded, and the kernel's argmax.

It is the XLA executor with a different forward: batches the layer kernel does not take (larger than
cpu_kernels.max_kernel_rows() where AMX makes XLA's dot faster, or any batch under tensor parallelism) run the Flax
model with the C++ attention kernel ("cpu" attention backend) and XLA's dots. A model whose layers differ in window
or rotary embedding (Gemma 2/3, SmolLM3, some Qwen) runs one kernel call per run of alike layers (LayerGroup), its
weights and KV cache per layer instead of stacked.

int8 weights (quantization "int8", or stored int8: jserve.models.quantization) are packed with their per-row scales
(cpu_kernels.pack_weight_int8) and widened in registers by the kernels' matmuls; the layer kernel then takes every
batch on one device (the packed layout is its alone), and under tensor parallelism the Flax model's quantized
Linears run as on the XLA executor, their scales sharded with their rows.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

import cpu_kernels
from checkpoints.safetensors_loader import ParamSource
from jserve.config import ModelConfig, ModelLoadError
from jserve.executors.host_arena import HugePageArena, LayerStacks
from jserve.executors.xla import XlaExecutor
from jserve.loading import LoadedModel, load_model, model_config, pooling_config, stored_quantization
from jserve.models.batch import KVCache, StepBatch
from jserve.models.layers import embed_lookup, embedding_multiplier, matmul, rms_norm, rope_inv_freq, soft_cap
from pallas_kernels.quantized import QuantizedPages, zeros_pages

logger = logging.getLogger(__name__)

# Where each of the layer kernel's weights sits in a DecoderLayer (absent where the model has no such weight); the
# loader stacks each across layers by these paths (host_arena.LayerStacks).
# The C++ attention kernel keeps a page's scores on the stack and refuses pages over 64 tokens (attention.h); the
# engine checks block_size against it at construction so the error names the flag instead of failing a step.
MAX_BLOCK_SIZE = 64

KERNEL_WEIGHT_PATHS = cpu_kernels.LayerWeights(
    input_norm=("input_layernorm", "weight"), qkv=("self_attn", "qkv_proj", "weight"),
    o=("self_attn", "o_proj", "weight"), post_norm=("post_attention_layernorm", "weight"),
    gate_up=("mlp", "gate_up_proj", "weight"), down=("mlp", "down_proj", "weight"),
    qkv_bias=("self_attn", "qkv_proj", "bias"), o_bias=("self_attn", "o_proj", "bias"),
    gate_up_bias=("mlp", "gate_up_proj", "bias"), down_bias=("mlp", "down_proj", "bias"),
    q_norm=("self_attn", "q_norm", "weight"), k_norm=("self_attn", "k_norm", "weight"))
_MATRICES = (KERNEL_WEIGHT_PATHS.qkv, KERNEL_WEIGHT_PATHS.o, KERNEL_WEIGHT_PATHS.gate_up, KERNEL_WEIGHT_PATHS.down)
# Gemma 2/3: the MLP's input norm is pre_feedforward_layernorm; post_attention_layernorm and post_feedforward_layernorm
# normalize the attention and MLP outputs (the kernel's sandwich norms).
SANDWICH_WEIGHT_PATHS = KERNEL_WEIGHT_PATHS._replace(
    post_norm=("pre_feedforward_layernorm", "weight"), attn_out_norm=("post_attention_layernorm", "weight"),
    mlp_out_norm=("post_feedforward_layernorm", "weight"))


def kernel_weight_paths(config: ModelConfig) -> cpu_kernels.LayerWeights:
    return SANDWICH_WEIGHT_PATHS if config.sandwich_norms else KERNEL_WEIGHT_PATHS


@dataclass(frozen=True)
class LayerGroup:
    """A run of consecutive layers alike in window and rotary embedding: one layer-kernel call."""

    start: int
    end: int
    sliding_window: int | None
    rotary: int  # ModelConfig.layer_rotary: 0 rope_theta's frequencies, 1 the local base's, 2 none


def layer_groups(config: ModelConfig) -> list[LayerGroup]:
    groups: list[LayerGroup] = []
    for i in range(config.num_layers):
        window, rotary = config.layer_window(i), config.layer_rotary(i)
        if groups and (groups[-1].sliding_window, groups[-1].rotary) == (window, rotary):
            groups[-1] = dataclasses.replace(groups[-1], end=i + 1)
        else:
            groups.append(LayerGroup(i, i + 1, window, rotary))
    return groups


@dataclass
class CpuLoadedModel(LoadedModel):
    # Every layer's weights stacked by kind ([num_layers, ...], aliasing the state's per-layer arrays, or the matrices
    # in per-thread parts), for the layer kernel; None where they could not be stacked without a copy.
    layer_stack: cpu_kernels.LayerWeights | None = None

    quantization: str | None = None  # "int8": the layers' matrices packed with their scales (pack_weight_int8)

    def resident_bytes(self) -> int:
        # The layers' own matrices are empty placeholders where the matrices lie in per-thread parts.
        parts = None if self.layer_stack is None else self.layer_stack.matrix_parts
        return super().resident_bytes() + (0 if parts is None else parts.size * parts.dtype.itemsize)


class CpuLayerExecutor(XlaExecutor):
    name = "cpu-layers"
    smallest_token_bucket = 1  # the kernels stream weights at any row count: a lone decode stays one row
    argmax = staticmethod(cpu_kernels.argmax)  # XLA CPU's argmax runs ~20x slower (same answer)

    @classmethod
    def load(cls, model_dir: str | Path, *, dtype: str, attention_backend: str = "cpu", mesh: Mesh | None = None,
             load_format: str = "auto", weight_parts: int | None = None,
             quantization: str | None = None, max_model_len: int | None = None,
             lora: tuple[int, int] = (0, 0), pooling: bool = False) -> LoadedModel:
        """weight_parts: where the matmul weights are packed, the layers' matrices are laid out in this many per-thread
        parts (cpu_kernels.PartLayout; None: one per CPU the kernels run on; 0: as [num_layers, ...] stacks whose
        slices are the layers' own parameters). In parts, only the layer kernel reads them (through
        CpuLoadedModel.layer_stack): each layer's own matrix parameters are empty placeholders.
        quantization: "int8" quantizes the layers' matrices at load (stored int8 weights are int8 whatever it says);
        they are packed with their scales, in parts or stacks like float ones (each layer's scale parameter keeps
        its float32 scales: the kernel reads the copy inside the packed blocks)."""
        if quantization not in (None, "int8"):
            raise ValueError(f"executor 'cpu-layers' has no {quantization} matmul kernels; quantization "
                             f"{quantization!r} needs executor 'xla'")
        if mesh is not None:  # sharded: XLA partitions the dots, the attention kernel runs on each device's heads
            return load_model(model_dir, dtype, attention_backend, mesh=mesh, load_format=load_format,
                              quantization=quantization, max_model_len=max_model_len, lora=lora, pooling=pooling)
        config = model_config(model_dir, max_model_len)
        config = pooling_config(config) if pooling else config
        if not layer_kernel_takes(config) or lora[0]:
            return _load_packed_for_flax(model_dir, config, dtype, attention_backend, load_format, quantization,
                                         max_model_len, lora)
        param_dtype = jnp.dtype(dtype)
        packed = _packed_paths(config, param_dtype) if cpu_kernels.packs_weights(param_dtype) else set()
        # int8 may come from the checkpoint itself (compressed-tensors, a quantized conversion): its matrices reach
        # place_quantized below whatever `quantization` says, so their layout is int8 where int8 can be stored.
        int8 = quantization == "int8" or stored_quantization(model_dir, load_format) == "int8"
        arena = HugePageArena()
        # per-thread parts are stacked across layers: one call takes every layer, so its layers must be alike
        in_parts = weight_parts != 0 and len(layer_groups(config)) == 1 and \
            (int8 or all(("layers", 0, *path) in packed for path in _MATRICES))
        parts = weight_parts if weight_parts is not None else cpu_kernels.kernel_threads()
        matrix_dtype = jnp.dtype(jnp.int8) if int8 else param_dtype
        layout = cpu_kernels.part_layout(_matrix_shapes(config), matrix_dtype, parts) if in_parts else None
        stacks = LayerStacks(arena, config.num_layers,
                             (layout, {path: i for i, path in enumerate(_MATRICES)}) if in_parts else None)

        def place(path: tuple, source: ParamSource) -> jax.Array:
            array = source.read()
            array = cpu_kernels.pack_weight(array) if path in packed else array
            if path[0] == "layers":
                return stacks.place(path[2:], path[1], array)
            return arena.place(array)

        def place_quantized(path: tuple, q: np.ndarray, scale: np.ndarray) -> tuple[jax.Array, jax.Array]:
            if q.dtype != np.int8:
                raise ModelLoadError(f"executor 'cpu-layers' takes int8 weights, not {q.dtype} ({path})")
            packed_q = cpu_kernels.pack_weight_int8(q, scale)
            if path[0] != "layers":  # the LM head (a tied embedding table: its lookups read the packed rows too)
                return arena.place(packed_q), jax.device_put(scale)
            return stacks.place(path[2:], path[1], packed_q), jax.device_put(scale)

        model = load_model(model_dir, dtype, attention_backend, load_format=load_format, place=place,
                           quantization=quantization, place_quantized=place_quantized, max_model_len=max_model_len,
                           lora=lora, pooling=pooling)
        return CpuLoadedModel(config=model.config, graphdef=model.graphdef, state=model.state,
                              attention_backend=attention_backend, layer_stack=_layer_stack(stacks, config),
                              quantization="int8" if int8 else None)

    def __init__(self, model: LoadedModel, *, max_num_batched_tokens: int, mesh: Mesh | None = None, **kwargs):
        if kwargs.get("kv_cache_dtype", "auto") == "fp8":  # the C++ kernels read int8 pages, not e4m3 ones
            raise ValueError("executor 'cpu-layers' reads an int8 KV cache but not an fp8 one; kv_cache_dtype "
                             "'fp8' needs executor 'xla' (or 'auto')")
        # Where the layer kernel takes every step (one device, no bucket larger than it takes), the cache is one
        # stacked array for K and one for V, and so are the layers' weights where the loader stacked them: a step
        # then dispatches ~16 arrays instead of a few per layer.
        # int8 matrices are packed for the layer kernel only: it takes every batch on one device.
        self.int8_layers = mesh is None and getattr(model, "quantization", None) == "int8"
        # One kernel call a run of alike layers (every layer at once where they are all alike: then stacked).
        self.layer_groups = layer_groups(model.config)
        self.weight_paths = kernel_weight_paths(model.config)
        # the rest of the models the layer kernel does not take, and any with adapters, are the Flax model on
        # packed weights
        self.flax_layers = not layer_kernel_takes(model.config) or model.config.max_loras > 0
        self.every_step_fused = mesh is None and not self.flax_layers and len(self.layer_groups) == 1 and (
            self.int8_layers or max_num_batched_tokens <= cpu_kernels.max_kernel_rows())
        self.layer_stack = getattr(model, "layer_stack", None) if self.every_step_fused else None
        if self.layer_stack is None and _matrices_in_parts(model):
            raise ValueError("this model's layer matrices were loaded in per-thread parts for the layer kernel, "
                             "which does not take every step here: load it with weight_parts=0")
        super().__init__(model, max_num_batched_tokens=max_num_batched_tokens, mesh=mesh, **kwargs)

    def _param_tree(self, model: LoadedModel) -> Any:
        if self.layer_stack is None:
            return model.state
        # The stacks alias the layers' own arrays: the step takes the stacks and the few weights outside the layers.
        pure = nnx.to_pure_dict(model.state)
        return {"embed": pure["embed_tokens"], "norm": pure["norm"]["weight"], "lm_head": pure.get("lm_head"),
                "layers": self.layer_stack}

    def _new_kv_cache(self, shape: tuple[int, ...], dtype: jnp.dtype) -> KVCache:
        if not self.every_step_fused:
            return super()._new_kv_cache(shape, dtype)
        stacked = (self.config.num_layers, *shape)
        if self.kv_cache_dtype != "auto":  # int8: one QuantizedPages each, its arrays stacked
            return KVCache(k=zeros_pages(stacked, self.dtype, self.kv_cache_dtype, "cpu"),
                           v=zeros_pages(stacked, self.dtype, self.kv_cache_dtype, "cpu"))
        return KVCache(k=jnp.zeros(stacked, dtype), v=jnp.zeros(stacked, dtype))

    def layer_kernel_takes(self, num_tokens: int) -> bool:
        return self.mesh is None and not self.flax_layers and (
            self.int8_layers or num_tokens <= cpu_kernels.max_kernel_rows())

    def _forward(self, params: list, kv_cache: KVCache, batch: StepBatch) -> tuple[KVCache, jax.Array]:
        tree = jax.tree.unflatten(self._params_tree, params)
        if self.layer_stack is not None:
            embed, norm, lm_head, layers = tree["embed"], tree["norm"], tree["lm_head"], tree["layers"]
        else:
            model = nnx.merge(self.graphdef, tree)
            if not self.layer_kernel_takes(batch.token_ids.shape[0]):
                return self._call_model(model, kv_cache, batch)
            embed, norm = model.embed_tokens[...], model.norm.weight[...]
            lm_head = None if model.lm_head is None else model.lm_head[...]
            layers = [_layer_weights(layer, self.weight_paths) for layer in model.layers]
        cfg = self.config
        x = cpu_kernels.packed_rows(embed, batch.token_ids) if cpu_kernels.is_packed(embed) \
            else embed_lookup(embed, batch.token_ids)
        multiplier = embedding_multiplier(cfg, self.dtype)
        if multiplier != 1.0:  # Granite, Gemma
            x = x * multiplier
        k_cache, v_cache, scales = kv_cache.k, kv_cache.v, {}
        quantized = self.kv_cache_dtype != "auto"
        if quantized:  # an int8 cache: the kernel takes the values and the scales as arrays (or lists of them)
            split = (lambda c, f: getattr(c, f)) if kv_cache.stacked else (lambda c, f: [getattr(p, f) for p in c])
            k_cache, v_cache = split(kv_cache.k, "values"), split(kv_cache.v, "values")
            scales = {"k_scales": split(kv_cache.k, "scales"), "v_scales": split(kv_cache.v, "scales")}
        # a NoPE layer rotates by frequency 0: cos 1, sin 0 leave q and k exactly as they are
        inv_freq = (rope_inv_freq(cfg), rope_inv_freq(cfg, local=True), np.zeros(cfg.head_dim // 2, np.float32))
        kwargs = dict(positions=batch.positions, slot_mapping=batch.slot_mapping, page_table=batch.page_table,
                      query_start=batch.query_start, seq_lens=batch.seq_lens, num_heads=cfg.num_heads,
                      eps=cfg.rms_norm_eps, scale=cfg.attention_scale, soft_cap=cfg.attn_logit_softcapping,
                      intermediate_size=cfg.intermediate_size, compute_dtype=self.dtype, activation=cfg.hidden_act)
        if len(self.layer_groups) == 1:
            (group,) = self.layer_groups
            x, k_cache, v_cache, *new_scales = cpu_kernels.decoder_layers(
                x, layers, k_cache, v_cache, inv_freq=inv_freq[group.rotary], sliding_window=group.sliding_window,
                **kwargs, **scales)
        else:  # per layer (never stacked): one call a group, each taking its layers' weights, pages and scales
            k_cache, v_cache, new_scales = list(k_cache), list(v_cache), [list(scales.get(n, ())) for n in scales]
            for g in self.layer_groups:
                part = slice(g.start, g.end)
                group_scales = {name: value[part] for name, value in scales.items()}
                x, k_cache[part], v_cache[part], *group_new = cpu_kernels.decoder_layers(
                    x, layers[part], k_cache[part], v_cache[part], inv_freq=inv_freq[g.rotary],
                    sliding_window=g.sliding_window, **kwargs, **group_scales)
                for kept, new in zip(new_scales, group_new, strict=True):
                    kept[part] = new
        if quantized:
            k_scales, v_scales = new_scales
            if kv_cache.stacked:
                k_cache = QuantizedPages(k_cache, k_scales, self.dtype)
                v_cache = QuantizedPages(v_cache, v_scales, self.dtype)
            else:
                k_cache = [QuantizedPages(v, s, self.dtype) for v, s in zip(k_cache, k_scales, strict=True)]
                v_cache = [QuantizedPages(v, s, self.dtype) for v, s in zip(v_cache, v_scales, strict=True)]
        last = rms_norm(x[batch.logits_indices], norm, cfg.rms_norm_eps)  # only the positions that predict a token
        if cfg.pooling:  # an embedding model's output: the hidden states (jserve.engine.pooling)
            return KVCache(k=k_cache, v=v_cache), last.astype(jnp.float32)
        head = embed if lm_head is None else lm_head
        if cpu_kernels.is_packed(head) or last.shape[0] <= cpu_kernels.max_kernel_rows():
            logits = cpu_kernels.matmul(last, head, cfg.vocab_size, self.dtype)
        else:
            logits = matmul(last, head)
        return KVCache(k=k_cache, v=v_cache), soft_cap(logits, cfg.final_logit_softcapping)


def _layer_weights(layer: nnx.Module, paths: cpu_kernels.LayerWeights) -> cpu_kernels.LayerWeights:
    """A DecoderLayer's own weights as the layer kernel takes them."""
    def value(path: tuple[str, ...] | None) -> jax.Array | None:
        if path is None:  # a weight this family has no path for (the sandwich norms of a Llama)
            return None
        node = layer
        for name in path:
            node = getattr(node, name, None)
            if node is None:  # no bias, or no q/k norm
                return None
        return node[...]

    # Every path but matrix_parts, the last field: a layer's own weights are never in parts.
    return cpu_kernels.LayerWeights(*(value(path) for path in paths[:-1]))


def _matrices_in_parts(model: LoadedModel) -> bool:
    """The layers' own matrices are empty placeholders: the weights lie only in the per-thread parts."""
    layers = nnx.to_pure_dict(model.state).get("layers")
    attention = layers[0]["self_attn"] if layers else {}  # latent attention has no qkv_proj, and is never in parts
    return "qkv_proj" in attention and attention["qkv_proj"]["weight"].size == 0


def _matrix_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """[N, K] of a layer's qkv, o, gate_up and down weights."""
    e, q, kv, i = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    return [(q + 2 * kv, e), (e, q), (2 * i, e), (e, i)]


def _layer_stack(stacks: LayerStacks, config: ModelConfig) -> cpu_kernels.LayerWeights | None:
    """The kernel's weights from the stacks by kind (and the matrices' parts); None if a stack is missing or the
    layers hold a weight the kernel does not take."""
    paths = kernel_weight_paths(config)
    by_kind, matrix_parts = stacks.stacked(), stacks.matrix_parts()
    if by_kind is None or not set(by_kind) <= set(paths):
        if matrix_parts is not None:
            raise ModelLoadError("the layer kernel's weights could not all be stacked (a layer holds a weight it "
                                 "does not take), but its matrices are already laid out only for it")
        return None
    weights = cpu_kernels.LayerWeights(*(by_kind.get(path) for path in paths[:-1]), matrix_parts=matrix_parts)
    matrices = (weights.qkv, weights.o, weights.gate_up, weights.down)
    whole = matrix_parts is not None or all(w is not None for w in matrices)
    return weights if whole and weights.input_norm is not None and weights.post_norm is not None else None


def layer_kernel_takes(config: ModelConfig) -> bool:
    """Whether the C++ layer kernel runs this model's layers: dense MLPs, pre-norm or sandwich-norm blocks, q/k
    normalized per head if at all, no attention sinks, no latent attention. A mixture of experts and OLMo's blocks
    run as the Flax model on packed matmuls."""
    return not (config.num_experts or config.qk_norm_across_heads or config.post_norms or config.clip_qkv
                or config.attention_sinks or config.kv_lora_rank or config.attention_chunk_size)


def _load_packed_for_flax(model_dir: str | Path, config: ModelConfig, dtype: str, attention_backend: str,
                          load_format: str, quantization: str | None, max_model_len: int | None,
                          lora: tuple[int, int] = (0, 0)) -> LoadedModel:
    """A model the layer kernel does not take (layer_kernel_takes; LoRA adapters), for the Flax model with its
    matmuls on the C++ kernels: every projection, each expert's matrices (a stack of packed ones) and the LM head
    packed, which Linear, the experts and the head then multiply by through cpu_kernels.matmul / expert_matmul."""
    packed = _flax_packed_paths(config, jnp.dtype(dtype)) if cpu_kernels.packs_weights(dtype) else set()
    arena = HugePageArena()

    def experts(path: tuple) -> bool:
        return path[-3:-2] == ("experts",)

    def place(path: tuple, source: ParamSource) -> jax.Array:
        array = source.read()
        if path not in packed:
            return jax.device_put(array)
        return arena.place(np.stack([cpu_kernels.pack_weight(w) for w in array]) if experts(path)
                           else cpu_kernels.pack_weight(array))

    def place_quantized(path: tuple, q: np.ndarray, scale: np.ndarray) -> tuple[jax.Array, jax.Array]:
        if q.dtype != np.int8:
            raise ModelLoadError(f"executor 'cpu-layers' takes int8 weights, not {q.dtype} ({path})")
        packed_q = (np.stack([cpu_kernels.pack_weight_int8(w, s) for w, s in zip(q, scale, strict=True)])
                    if experts(path) else cpu_kernels.pack_weight_int8(q, scale))
        return arena.place(packed_q), jax.device_put(scale)

    return load_model(model_dir, dtype, attention_backend, load_format=load_format, place=place,
                      quantization=quantization, place_quantized=place_quantized, max_model_len=max_model_len,
                      lora=lora, pooling=config.pooling)


def _flax_packed_paths(config: ModelConfig, dtype: jnp.dtype) -> set[tuple]:
    """What _load_packed_for_flax packs: the layers' projections (attention, dense MLPs, shared experts), the
    experts' stacks and the LM head."""
    paths = {("embed_tokens",) if config.tie_word_embeddings else ("lm_head",)}
    attention = ("qkv_proj", "o_proj")
    if config.kv_lora_rank:  # latent attention: its projections but kv_b_proj, multiplied head by head (models.mla)
        attention = ("q_a_proj", "q_b_proj") if config.q_lora_rank else ("q_proj",)
        attention += ("kv_a_proj_with_mqa", "o_proj")
    for i in range(config.num_layers):
        paths |= {("layers", i, "self_attn", name, "weight") for name in attention}
        mlp = ("layers", i, "mlp")
        if not config.layer_moe(i):
            paths |= {(*mlp, name, "weight") for name in ("gate_up_proj", "down_proj")}
            continue
        paths |= {(*mlp, "experts", name, "weight") for name in ("gate_proj", "up_proj", "down_proj")}
        if config.shared_expert_intermediate_size:
            paths |= {(*mlp, "shared_expert", name, "weight") for name in ("gate_up_proj", "down_proj")}
    sizes = (config.hidden_size, config.q_size, config.intermediate_size, config.moe_intermediate_size,
             config.shared_expert_intermediate_size, config.q_lora_rank, config.num_heads * config.v_head_dim)
    if dtype == jnp.bfloat16 and any(size % 2 for size in sizes):
        return set()  # the bfloat16 layout pairs adjacent inputs
    return paths


def _packed_paths(config: ModelConfig, dtype: jnp.dtype) -> set[tuple]:
    """The parameters only the kernels' matmuls read: every projection and the LM head (a tied embedding table
    too: its lookup reads the packed rows, cpu_kernels.packed_rows)."""
    projections = [("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj")]
    paths = {("layers", i, *module, "weight") for i in range(config.num_layers) for module in projections}
    paths.add(("embed_tokens",) if config.tie_word_embeddings else ("lm_head",))
    sizes = (config.hidden_size, config.q_size, config.intermediate_size)
    if dtype == jnp.bfloat16 and any(size % 2 for size in sizes):
        return set()  # the bfloat16 layout pairs adjacent inputs
    return paths
