"""Tensor and data parallelism: the device mesh, the one logical-axis -> mesh-axis rules table, and the
shape changes tensor parallelism implies (fused-matrix layout, KV-head replication). Models carry no sharding
logic: they name their axes; this package decides where those axes live."""

from sharding.mesh import DATA_AXIS, MODEL_AXIS, make_mesh, replica_meshes
from sharding.rules import (
    KV_CACHE_AXES,
    LOGICAL_AXIS_RULES,
    kv_head_replicas,
    logical_sharding,
    logical_spec,
    replicated,
)

__all__ = ["DATA_AXIS", "KV_CACHE_AXES", "LOGICAL_AXIS_RULES", "MODEL_AXIS", "kv_head_replicas", "logical_sharding",
           "logical_spec", "make_mesh", "replica_meshes", "replicated"]
