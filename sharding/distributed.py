"""Multi-host primitives on JAX's own multi-controller runtime (jax.distributed): join, agree on a value, and
carry one step's plan a step from the leader to every follower through the coordination service's key-value store.

A process that dies stops sending heartbeats; the coordination service then fails every other process (a non-zero
exit) within HEARTBEAT_TIMEOUT_S, so nothing hangs forever.
"""

from __future__ import annotations

import logging

import jax
import numpy as np
from jax._src import distributed  # the runtime's client: its key-value store carries the step plans

logger = logging.getLogger(__name__)

HEARTBEAT_TIMEOUT_S = 10  # a silent peer is declared dead after this long (jax's default is 100 s)
POLL_MS = 1000  # followers wait for the next step in slices of this length


def initialize(coordinator_address: str | None, num_processes: int, process_id: int) -> None:
    """Join the multi-process runtime (once, before anything touches a device); one process: nothing to join."""
    if num_processes == 1 or distributed.global_state.client is not None:
        return
    jax.distributed.initialize(coordinator_address, num_processes, process_id,
                               heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)
    logger.info("process %d of %d joined %s: %d local / %d global devices", jax.process_index(),
                jax.process_count(), coordinator_address, jax.local_device_count(), jax.device_count())


def agree_on_min(value: int) -> int:
    """The smallest of every process's value (e.g. KV blocks that fit its chips), so all build the same shapes."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.asarray(value, np.int64))))


class StepChannel:
    """Step plans (bytes) from the leader to the followers: one key per step, read in order."""

    def __init__(self):
        self.client = distributed.global_state.client
        self.step = 0

    def publish(self, plan: bytes | None) -> None:
        """Send the next step's plan; None tells the followers to stop."""
        self.client.key_value_set_bytes(f"jserve/step/{self.step}", b"" if plan is None else plan)
        if self.step >= 8:  # every follower has run step n - 8: each step's collectives wait for all of them
            self.client.key_value_delete(f"jserve/step/{self.step - 8}")
        self.step += 1

    def receive(self) -> bytes | None:
        key = f"jserve/step/{self.step}"
        while True:
            try:
                data = self.client.blocking_key_value_get_bytes(key, POLL_MS)
                break
            except Exception as e:  # the runtime raises a generic error on timeout: keep waiting while idle
                if "DEADLINE_EXCEEDED" not in str(e).upper() and "TIMED OUT" not in str(e).upper():
                    raise
        self.step += 1
        return data if data else None
