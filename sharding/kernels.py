"""Kernels under tensor parallelism: XLA cannot split a Pallas custom call over devices, so each device runs the
kernel on its own heads inside a shard_map (attention never mixes heads, so no collective is needed)."""

from __future__ import annotations

import jax
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from sharding.mesh import MODEL_AXIS

HEADS = P(None, MODEL_AXIS, None)  # q and the output: [T, heads, head_dim]
KV_HEADS = P(None, None, MODEL_AXIS, None)  # one layer's cache: [pages, page_slot, kv_heads, head_dim]


def model_parallel_mesh() -> AbstractMesh | None:
    """The mesh being traced under, when its model axis splits heads and we are not already inside shard_map.
    (the XLA executor traces the step under its mesh; with one device there is none.)"""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.shape.get(MODEL_AXIS, 1) == 1 or MODEL_AXIS in mesh.manual_axes:
        return None
    return mesh
