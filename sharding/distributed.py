"""Multi-host serving on JAX's own multi-controller runtime (jax.distributed).

Every process builds the same mesh over all processes' devices and runs the same jitted step. Process 0 (the
leader) runs the scheduler (and the HTTP server); before each step it publishes the step's batch through the
coordination service's key-value store, and the followers run exactly that step, so every collective is
entered by every process in the same order. A process that dies stops sending heartbeats; the coordination
service then fails every other process (a non-zero exit) within HEARTBEAT_TIMEOUT_S, so nothing hangs forever.
"""

from __future__ import annotations

import atexit
import io
import logging

import jax
import numpy as np
from jax._src import distributed  # the runtime's client: its key-value store carries the step plans

from jserve.config import EngineConfig
from jserve.engine.runner import ModelRunner
from jserve.models.batch import StepBatch
from sharding.rules import replicated

logger = logging.getLogger(__name__)

HEARTBEAT_TIMEOUT_S = 10  # a silent peer is declared dead after this long (jax's default is 100 s)
POLL_MS = 1000  # followers wait for the next step in slices of this length


def initialize(config: EngineConfig) -> None:
    """Join the multi-process runtime (once, before anything touches a device)."""
    if config.num_processes == 1 or distributed.global_state.client is not None:
        return
    jax.distributed.initialize(config.coordinator_address, config.num_processes, config.process_id,
                               heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)
    logger.info("process %d of %d joined %s: %d local / %d global devices", jax.process_index(),
                jax.process_count(), config.coordinator_address, jax.local_device_count(), jax.device_count())


def agree_on_min(value: int) -> int:
    """The smallest of every process's value (e.g. KV blocks that fit its chips), so all build the same shapes."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.asarray(value, np.int64))))


class StepChannel:
    """Step plans from the leader to the followers: one key per step, read in order."""

    def __init__(self):
        self.client = distributed.global_state.client
        self.step = 0

    def publish(self, batch: StepBatch | None) -> None:
        """Send the next step's batch; None tells the followers to stop."""
        self.client.key_value_set_bytes(f"jserve/step/{self.step}", b"" if batch is None else _encode(batch))
        if self.step >= 8:  # every follower has run step n - 8: each step's collectives wait for all of them
            self.client.key_value_delete(f"jserve/step/{self.step - 8}")
        self.step += 1

    def receive(self) -> StepBatch | None:
        key = f"jserve/step/{self.step}"
        while True:
            try:
                data = self.client.blocking_key_value_get_bytes(key, POLL_MS)
                break
            except Exception as e:  # the runtime raises a generic error on timeout: keep waiting while idle
                if "DEADLINE_EXCEEDED" not in str(e).upper() and "TIMED OUT" not in str(e).upper():
                    raise
        self.step += 1
        return _decode(data) if data else None


class MultiHostRunner(ModelRunner):
    """A ModelRunner whose mesh spans processes: the leader publishes each batch, every process runs it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.is_leader = jax.process_index() == 0
        self.channel = StepChannel()
        if self.is_leader:
            atexit.register(self.stop_followers)  # runs before jax.distributed's own atexit shutdown

    def run(self, batch: StepBatch) -> jax.Array:
        if self.is_leader:
            self.channel.publish(batch)
        sharding = replicated(self.mesh)
        global_batch = jax.tree.map(lambda a: jax.make_array_from_callback(a.shape, sharding, lambda i: a[i]),
                                    batch)
        # The logits are replicated: keep this process's copy, so the sampler runs locally on the leader.
        return super().run(global_batch).addressable_data(0)

    def follow(self) -> None:
        """A follower's whole life: run the leader's steps until it says stop (or the runtime fails us)."""
        while (batch := self.channel.receive()) is not None:
            self.run(batch)
        logger.info("leader stopped; follower %d exits", jax.process_index())

    def stop_followers(self) -> None:
        if self.is_leader:
            self.is_leader = False
            self.channel.publish(None)


def run_follower(config: EngineConfig) -> None:
    """What `jserve serve` runs on processes other than 0: no HTTP server, no scheduler, just the leader's steps."""
    from jserve.engine.engine import LLMEngine

    engine = LLMEngine(config.replace(warmup=False))  # warm-up batches arrive from the leader like any other
    engine.runner.follow()


def _encode(batch: StepBatch) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **{k: np.asarray(v) for k, v in vars(batch).items()})
    return buf.getvalue()


def _decode(data: bytes) -> StepBatch:
    with np.load(io.BytesIO(data)) as arrays:
        return StepBatch(**{k: arrays[k] for k in arrays.files})
