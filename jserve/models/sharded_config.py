"""A model's shape as one tensor-parallel replica runs it: what the checkpoint loader lays out, the model computes."""

from __future__ import annotations

import dataclasses

from jserve.config import ModelConfig
from sharding import kv_head_replicas


def shard_model_config(config: ModelConfig, tensor_parallel_size: int) -> ModelConfig:
    """config reshaped for a `model` mesh axis of tensor_parallel_size devices (sharding.kv_head_replicas says
    why, and rejects sizes that do not split the model evenly).

    Fused q|k|v and gate|up matrices are stored as `fused_shards` = TP row blocks, block i holding the [q | k | v]
    rows of device i's own heads (and [gate | up] of its own MLP columns). We reorder at load time rather than
    unfuse because the fused matmul is the fast path on CPU (a fixed cost per dot) and costs nothing on TPU; with
    TP = 1 the layout is exactly the unsharded one. When TP exceeds the KV heads, each checkpoint KV head is
    repeated `kv_head_replicas` times and num_kv_heads counts the copies.
    """
    tp = tensor_parallel_size
    if tp == 1:
        return config
    for field in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(config, field) % tp:  # each device takes an equal slice of every expert's columns
            raise ValueError(f"tensor_parallel_size {tp} does not divide {field}={getattr(config, field)}")
    replicas = kv_head_replicas(config.num_heads, config.num_kv_heads, config.intermediate_size, tp)
    if replicas > 1 and config.qk_norm_across_heads:  # its k_norm spans the checkpoint's KV heads, not their copies
        raise ValueError(f"tensor_parallel_size {tp} exceeds the model's {config.num_kv_heads} KV heads, which its "
                         "k norm spans together (OLMo): use a tensor_parallel_size of at most the KV heads")
    return dataclasses.replace(config, num_kv_heads=config.num_kv_heads * replicas, kv_head_replicas=replicas,
                               fused_shards=tp)
