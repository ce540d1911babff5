"""The device mesh: axes ("data", "model"); `model` splits one replica's weights, `data` holds replicas."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

DATA_AXIS = "data"
MODEL_AXIS = "model"


def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A [data, model] mesh over the first dp * tp devices (all processes' devices under jax.distributed).

    The model axis is the fastest-varying one, so on TPU the devices of one replica are neighbours on the
    interconnect (jax.make_mesh picks the physical order when the mesh covers every device).
    """
    needed = tensor_parallel_size * data_parallel_size
    devices = list(jax.devices() if devices is None else devices)
    if needed > len(devices):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} x data_parallel_size={data_parallel_size} "
                         f"needs {needed} devices, but only {len(devices)} are visible ({devices[0].platform}); "
                         "on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N makes N devices")
    shape = (data_parallel_size, tensor_parallel_size)
    if needed == len(devices) == jax.device_count():
        # Auto axes: GSPMD propagates the parameters' shardings through the step (jax.make_mesh would default to
        # Explicit axes, which demand an output sharding on every ambiguous op in the model).
        return jax.make_mesh(shape, (DATA_AXIS, MODEL_AXIS), (AxisType.Auto, AxisType.Auto), devices=devices)
    return Mesh(np.asarray(devices[:needed]).reshape(shape), (DATA_AXIS, MODEL_AXIS))


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One [1, model] mesh per data-parallel replica: each serves its own requests with its own KV cache."""
    return [Mesh(mesh.devices[i: i + 1], mesh.axis_names) for i in range(mesh.shape[DATA_AXIS])]
