"""The mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5, OLMoE, gpt-oss, DeepSeek-V2/V3, Granite MoE,
Llama 4): a router picks each token's top-k experts, each a SwiGLU MLP of its own, and the token's output is their
weighted sum (Llama 4: the sum of the experts of inputs so weighted) plus a shared expert (Qwen2-MoE's gated, the
others' not). gpt-oss adds biases to the router and the experts and clamps its SwiGLU.

Experts run grouped: every (token, chosen expert) pair is sorted by expert into tiles of `tile_rows(...)` rows,
each tile holding one expert's tokens (a group's last tile padded), and a loop over the tiles multiplies each by
its expert's matrices. A step then reads only the experts its tokens chose (a decode step of one token, k of
them), each about once, and computes at most about twice the rows it needs, where `jax.lax.ragged_dot` lowers on
CPU (and, as far as public reports go, on GPU) to every token against every expert. A tile past the used ones, and
the pairs of padding tokens, are skipped.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

import cpu_kernels
from jserve.config import ModelConfig
from jserve.models.layers import Linear, matmul, mlp_activation, param
from jserve.models.quantization import quantized_matmul


class Router(Linear):
    """The router's (and Qwen2-MoE's shared-expert gate's) linear map: kept in float under weight quantization,
    since its rounding would change which experts a token reaches (vLLM keeps it unquantized too). With
    correction_bias (GLM-4.5), the learned bias its grouped sigmoid routing adds to the scores it chooses by."""

    quantizable = False

    def __init__(self, in_features: int, out_features: int, *, dtype: jnp.dtype, correction_bias: bool = False,
                 bias: bool = False):
        super().__init__(in_features, out_features, dtype=dtype, axes=(None, "embed"), bias=bias)
        self.e_score_correction_bias = param((out_features,), jnp.float32, (None,)) if correction_bias else None


class ExpertLinear(nnx.Module):
    """One projection of every expert: weight [num_experts, out, in] (each expert's Hugging Face [out, in]), and
    with bias (gpt-oss) float32 bias [num_experts, out]."""

    quantizable = True  # jserve.models.quantization: int8 / fp8 with float32 scale [num_experts, out]

    def __init__(self, num_experts: int, in_features: int, out_features: int, *, dtype: jnp.dtype,
                 axes: tuple[str, str], bias: bool = False):
        self.weight = param((num_experts, out_features, in_features), dtype, ("expert", *axes))
        self.bias = param((num_experts, out_features), jnp.float32, ("expert", axes[0])) if bias else None
        self.scale: nnx.Param | None = nnx.data(None)
        self.compute_dtype = jnp.dtype(dtype)
        self.out_features = out_features

    def __call__(self, x: jax.Array, expert: jax.Array) -> jax.Array:
        """x[rows, in] through expert `expert` (a traced index) -> float32[rows, out]."""
        y = expert_matmul(x, self.weight[...], None if self.scale is None else self.scale[...], expert,
                          self.compute_dtype, self.out_features)
        return y if self.bias is None else y + jax.lax.dynamic_index_in_dim(self.bias[...], expert, keepdims=False)


def expert_matmul(x: jax.Array, weight: jax.Array, scale: jax.Array | None, expert: jax.Array,
                  compute_dtype: jnp.dtype, out_features: int) -> jax.Array:
    """x[rows, in] @ expert `expert`'s weight[out, in]^T -> float32[rows, out]. The CPU layer executor's experts
    are stacks of packed matrices (an int8 one holding its scales), which the C++ matmul reads in place."""
    if cpu_kernels.is_packed_stack(weight):
        return cpu_kernels.expert_matmul(x, weight, expert, out_features, compute_dtype)
    w = jax.lax.dynamic_index_in_dim(weight, expert, keepdims=False)
    if scale is None:
        return matmul(x, w)
    return quantized_matmul(x, w, jax.lax.dynamic_index_in_dim(scale, expert, keepdims=False), compute_dtype)


class Experts(nnx.Module):
    def __init__(self, config: ModelConfig, dtype: jnp.dtype):
        e, hidden, width = config.num_experts, config.hidden_size, config.moe_intermediate_size
        bias = config.moe_bias
        self.gate_proj = ExpertLinear(e, hidden, width, dtype=dtype, axes=("mlp", "embed"), bias=bias)
        self.up_proj = ExpertLinear(e, hidden, width, dtype=dtype, axes=("mlp", "embed"), bias=bias)
        self.down_proj = ExpertLinear(e, width, hidden, dtype=dtype, axes=("embed", "mlp"), bias=bias)
        self.activation = config.hidden_act
        self.swiglu_limit, self.swiglu_alpha = config.swiglu_limit, config.swiglu_alpha

    def glu(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        """The gated activation of an expert's gate and up projections (float32 [rows, width])."""
        if self.swiglu_limit is None:
            return mlp_activation(gate, self.activation) * up
        # gpt-oss: both clamped, up shifted by one, the gate's sigmoid sharpened by alpha
        gate = jnp.minimum(gate, self.swiglu_limit)
        up = jnp.clip(up, -self.swiglu_limit, self.swiglu_limit)
        return gate * jax.nn.sigmoid(gate * self.swiglu_alpha) * (up + 1)


def tile_rows(num_pairs: int, num_experts: int) -> int:
    """Rows of a tile: 1 where the pairs are no more than the experts (decode), else the power of two nearest
    above the pairs an expert gets on average."""
    return 1 << max(0, math.ceil(math.log2(max(1.0, num_pairs / num_experts))))


def route(logits: jax.Array, k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E] -> (weights float32[T, k], expert ids int32[T, k]): the softmax's k largest, summing to
    1 with normalize (transformers' order: softmax over every expert, then top-k)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def route_topk_softmax(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """gpt-oss's routing: the k largest router logits [T, E], weighted by their own softmax (top-k, then softmax)."""
    top, ids = jax.lax.top_k(logits.astype(jnp.float32), k)
    return jax.nn.softmax(top, axis=-1), ids.astype(jnp.int32)


def route_sigmoid_groups(logits: jax.Array, k: int, normalize: bool, correction: jax.Array, groups: int,
                         topk_groups: int, scale: float) -> tuple[jax.Array, jax.Array]:
    """GLM-4.5's (and DeepSeek-V3's) routing, in transformers' order: sigmoid scores; each token keeps the
    topk_groups of its `groups` expert groups whose two best corrected scores (score + correction) sum highest, and
    chooses its k experts there by corrected score; their weights are the uncorrected scores (renormalized with
    normalize), times scale."""
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))  # [T, E]
    return _route_in_groups(scores, scores + correction, k, normalize, groups, topk_groups, 2, scale)


def route_softmax_groups(logits: jax.Array, k: int, normalize: bool, groups: int, topk_groups: int, scale: float
                         ) -> tuple[jax.Array, jax.Array]:
    """DeepSeek-V2's routing: softmax scores; with groups > 1 (group_limited_greedy) each token keeps the
    topk_groups of its `groups` expert groups whose best scores are highest and chooses its k experts there; the
    weights (renormalized with normalize) times scale."""
    scores = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    return _route_in_groups(scores, scores, k, normalize, groups, topk_groups, 1, scale)


def _route_in_groups(scores: jax.Array, choice: jax.Array, k: int, normalize: bool, groups: int, topk_groups: int,
                     group_best: int, scale: float) -> tuple[jax.Array, jax.Array]:
    """The k experts of highest `choice` [T, E] within each token's topk_groups of `groups` groups whose group_best
    highest choices sum highest, weighted by their `scores` (renormalized with normalize) times scale."""
    num_tokens, num_experts = choice.shape
    per_group = num_experts // groups
    if groups > 1:
        best = jax.lax.top_k(choice.reshape(num_tokens, groups, per_group), min(group_best, per_group))[0].sum(-1)
        _, kept = jax.lax.top_k(best, topk_groups)  # [T, topk_groups]
        mask = jnp.zeros((num_tokens, groups), bool).at[jnp.arange(num_tokens)[:, None], kept].set(True)
        choice = jnp.where(jnp.repeat(mask, per_group, axis=1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * scale, ids.astype(jnp.int32)


def grouped_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, valid: jax.Array, experts: Experts,
                    scale_inputs: bool = False) -> jax.Array:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t with valid[t] -> float32[T, H] (zeros for
    the others); with scale_inputs (Llama 4) sum_j expert_{ids[t, j]}(weights[t, j] * x[t]). x [T, H]; weights, ids
    [T, k]; valid bool[T]."""
    num_tokens, k = ids.shape
    num_experts, hidden = experts.gate_proj.weight.shape[0], x.shape[-1]
    pairs = num_tokens * k
    rows = tile_rows(pairs, num_experts)
    capacity = -(-(pairs + num_experts * (rows - 1)) // rows) * rows  # every group padded to whole tiles
    num_tiles = capacity // rows

    pair_expert = jnp.where(valid[:, None], ids, num_experts).reshape(-1)  # [P]; num_experts: dropped
    order = jnp.argsort(pair_expert, stable=True)
    sorted_expert = pair_expert[order]
    counts = jnp.bincount(pair_expert, length=num_experts + 1)[:num_experts]  # [E]
    padded = (counts + rows - 1) // rows * rows
    padded_end = jnp.cumsum(padded)
    padded_start, group_start = padded_end - padded, jnp.cumsum(counts) - counts
    expert = jnp.minimum(sorted_expert, num_experts - 1)
    dest = jnp.where(sorted_expert < num_experts,
                     padded_start[expert] + jnp.arange(pairs) - group_start[expert], capacity)  # [P]
    tokens = order // k
    pair_weights = weights.reshape(-1)[order]
    x_in = (x[tokens] * pair_weights[:, None]).astype(x.dtype) if scale_inputs else x[tokens]
    x_rows = jnp.zeros((capacity, hidden), x.dtype).at[dest].set(x_in, mode="drop")
    # each tile's expert: the first whose padded rows end after the tile's start (num_experts past the last)
    tile_expert = jnp.searchsorted(padded_end, jnp.arange(num_tiles) * rows, side="right").astype(jnp.int32)

    def tile(_, inputs):
        x_tile, e = inputs

        def run() -> jax.Array:
            return experts.down_proj(experts.glu(experts.gate_proj(x_tile, e), experts.up_proj(x_tile, e)), e)

        return None, jax.lax.cond(e < num_experts, run, lambda: jnp.zeros((rows, hidden), jnp.float32))

    _, y = jax.lax.scan(tile, None, (x_rows.reshape(num_tiles, rows, hidden), tile_expert))
    pair_out = jnp.take(y.reshape(capacity, hidden), dest, axis=0, mode="fill", fill_value=0)
    if not scale_inputs:
        pair_out = pair_out * pair_weights[:, None]
    return jnp.zeros((num_tokens, hidden), jnp.float32).at[tokens].add(pair_out)


class SparseMoeBlock(nnx.Module):
    """Hugging Face's names: `gate` (the router), `experts`, and the shared expert: Qwen2-MoE's `shared_expert` with
    its `shared_expert_gate`, GLM-4.5's `shared_experts` (read under the same name), ungated."""

    def __init__(self, config: ModelConfig, dtype: jnp.dtype, dense_mlp: type[nnx.Module]):
        self.config = config
        grouped = config.moe_routing in ("sigmoid_groups", "softmax_groups")
        # GLM-4.5 and DeepSeek route in float32 (transformers casts x and the router's weight to it)
        self.gate = Router(config.hidden_size, config.num_experts, dtype=jnp.float32 if grouped else dtype,
                           correction_bias=config.moe_routing == "sigmoid_groups", bias=config.moe_bias)
        self.experts = Experts(config, dtype)
        shared = config.shared_expert_intermediate_size
        self.shared_expert = dense_mlp(config, dtype, shared) if shared else None
        self.shared_expert_gate = Router(config.hidden_size, 1, dtype=dtype) if shared and config.shared_expert_gated \
            else None

    def __call__(self, x: jax.Array, valid: jax.Array) -> jax.Array:
        cfg = self.config
        if cfg.moe_routing == "sigmoid_groups":
            weights, ids = route_sigmoid_groups(self.gate(x), cfg.num_experts_per_tok, cfg.norm_topk_prob,
                                                self.gate.e_score_correction_bias[...], cfg.num_expert_groups,
                                                cfg.topk_expert_groups, cfg.routed_scaling_factor)
        elif cfg.moe_routing == "softmax_groups":
            weights, ids = route_softmax_groups(self.gate(x), cfg.num_experts_per_tok, cfg.norm_topk_prob,
                                                cfg.num_expert_groups, cfg.topk_expert_groups,
                                                cfg.routed_scaling_factor)
        elif cfg.moe_routing == "topk_softmax":
            weights, ids = route_topk_softmax(self.gate(x), cfg.num_experts_per_tok)
        elif cfg.moe_routing == "sigmoid_input":  # Llama 4: the chosen logits' sigmoids scale the experts' inputs
            top, ids = jax.lax.top_k(self.gate(x), cfg.num_experts_per_tok)
            weights = jax.nn.sigmoid(top.astype(jnp.float32))
        else:
            weights, ids = route(self.gate(x), cfg.num_experts_per_tok, cfg.norm_topk_prob)
        out = grouped_experts(x, weights, ids, valid, self.experts, scale_inputs=cfg.moe_routing == "sigmoid_input")
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            out = out + (shared if self.shared_expert_gate is None else jax.nn.sigmoid(self.shared_expert_gate(x))
                         * shared)
        return out
