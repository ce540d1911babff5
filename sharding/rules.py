"""The one table that maps logical axis names (declared on every parameter and on the KV cache) to mesh axes.

Megatron-style tensor parallelism falls out of it: projections into heads / MLP columns are split by their
output rows (`qkv`, `mlp` -> model), projections out of them by their input columns (`heads`, `mlp` -> model),
so each layer needs one all-reduce after attention and one after the MLP, which XLA inserts. The vocabulary is
split too (embedding lookup: masked gather + all-reduce; LM head: each device computes its slice of logits).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.mesh import DATA_AXIS, MODEL_AXIS

LOGICAL_AXIS_RULES: Mapping[str, str | None] = {
    "vocab": MODEL_AXIS,  # embedding rows and LM-head rows
    "embed": None,  # the residual stream stays whole on every device
    "qkv": MODEL_AXIS,  # fused q|k|v rows, laid out per shard (see kv_head_replicas)
    "heads": MODEL_AXIS,  # o_proj input columns
    "kv_heads": MODEL_AXIS,  # the KV cache: each device keeps only its own KV heads
    "mlp": MODEL_AXIS,  # gate|up rows (laid out per shard) and down_proj input columns; each expert's too
    "expert": None,  # every device holds its slice of every expert (tensor-parallel experts, not expert-parallel)
    "norm": None,
    "head_dim": None,
    "pages": None,
    "page_slot": None,
    "batch": DATA_AXIS,
}

# Logical axes of one layer's K or V cache, [num_pages, page_size, num_kv_heads, head_dim].
KV_CACHE_AXES = ("pages", "page_slot", "kv_heads", "head_dim")


def logical_spec(logical_axes: Sequence[str | None], shape: Sequence[int] | None = None, mesh: Mesh | None = None,
                 rules: Mapping[str, str | None] = LOGICAL_AXIS_RULES) -> PartitionSpec:
    """The PartitionSpec for an array with these logical axes.

    With a mesh and shape, a dimension the mesh axis does not divide stays whole (replicated) rather than
    padded: correctness first; kv_head_replicas rejects the cases where that would lose the memory saving
    on the large weights.
    """
    spec, used = [], set()
    for i, name in enumerate(logical_axes):
        axis = rules.get(name) if name is not None else None
        if axis is not None and mesh is not None and shape is not None and shape[i] % mesh.shape[axis]:
            axis = None
        if axis in used:  # one mesh axis may split only one dimension of an array
            axis = None
        used.add(axis)
        spec.append(axis)
    return PartitionSpec(*spec)


def logical_sharding(mesh: Mesh, logical_axes: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
    return NamedSharding(mesh, logical_spec(logical_axes, shape, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def kv_head_replicas(num_heads: int, num_kv_heads: int, intermediate_size: int, tensor_parallel_size: int) -> int:
    """How many copies of each checkpoint KV head a tensor-parallel replica keeps, after checking that the model
    axis splits the model into whole heads and equal MLP slices (ValueError naming the fields it does not divide).

    Fused q|k|v and gate|up matrices are then laid out in `tensor_parallel_size` row blocks, block i holding the
    rows of device i's own heads and MLP columns, so a plain row split over `model` gives each device whole heads
    with no resharding inside the step. When the model axis exceeds the KV heads, each KV head is repeated
    tensor_parallel_size / num_kv_heads times (vLLM's replication): the replica runs as a GQA model whose KV-head
    copies hold the same weights, and every device keeps exactly one KV head in its cache instead of all of them.
    """
    tp, kv = tensor_parallel_size, num_kv_heads
    problems = []
    if num_heads % tp:
        problems.append(f"num_attention_heads={num_heads}")
    if intermediate_size % tp:
        problems.append(f"intermediate_size={intermediate_size}")
    if kv % tp and tp % kv:
        problems.append(f"num_key_value_heads={kv} (nor does it divide {tp})")
    if problems:
        raise ValueError(f"tensor_parallel_size={tp} does not divide {', '.join(problems)}")
    return max(1, tp // kv)
