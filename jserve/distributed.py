"""Multi-host serving: the leader's steps run on every process (sharding.distributed carries them).

Every process builds the same mesh over all processes' devices and runs the same jitted step. Process 0 (the
leader) runs the scheduler (and the HTTP server); before each step it publishes the step's batch, and the followers
run exactly that step, so every collective is entered by every process in the same order.
"""

from __future__ import annotations

import atexit
import io
import logging

import jax
import numpy as np

from jserve.executors.xla import XlaExecutor
from jserve.models.batch import StepBatch
from sharding.distributed import StepChannel
from sharding.rules import replicated

logger = logging.getLogger(__name__)

# The message that tells followers the leader failed for good (a step batch is an .npz archive, which starts "PK").
LEADER_FAILED = b"jserve:leader-failed:"


class LeaderFailedError(RuntimeError):
    """A multi-host follower lost its leader: the leader failed for good, or the runtime stopped carrying its steps."""


class MultiHostExecutor(XlaExecutor):
    """An XLA executor whose mesh spans processes: the leader publishes each batch, every process runs it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.is_leader = jax.process_index() == 0
        self.channel = StepChannel()
        if self.is_leader:
            atexit.register(self.stop_followers)  # runs before jax.distributed's own atexit shutdown

    def run(self, batch: StepBatch) -> jax.Array:
        if self.is_leader:
            self.channel.publish(_encode(batch))
        sharding = replicated(self.mesh)
        global_batch = jax.tree.map(lambda a: jax.make_array_from_callback(a.shape, sharding, lambda i: a[i]),
                                    batch)
        # The logits are replicated: keep this process's copy, so the sampler runs locally on the leader.
        return super().run(global_batch).addressable_data(0)

    def follow(self) -> None:
        """A follower's whole life: run the leader's steps until it says stop. Raises LeaderFailedError when the
        leader says it failed or the runtime cannot deliver its next step, so the process exits non-zero and a
        supervisor restarts the group."""
        while True:
            try:
                data = self.channel.receive()
            except Exception as e:  # the leader went away (or the coordination service did)
                raise LeaderFailedError(f"lost the leader's steps: {type(e).__name__}: {e}") from e
            if data is None:
                break
            if data.startswith(LEADER_FAILED):
                reason = data[len(LEADER_FAILED):].decode("utf-8", "replace")
                raise LeaderFailedError(f"the leader failed: {reason}")
            self.run(_decode(data))
        logger.info("leader stopped; follower %d exits", jax.process_index())

    def stop_followers(self) -> None:
        if self.is_leader:
            self.is_leader = False
            self.channel.publish(None)

    def fail_followers(self, reason: str) -> None:
        """Tell the followers the leader failed for good (they exit non-zero); later steps are never published."""
        if self.is_leader:
            self.is_leader = False
            self.channel.publish(LEADER_FAILED + reason.encode("utf-8", "replace")[:4096])

    def reset_kv_cache(self) -> None:
        """Refused: a failed step may have left the followers inside its collectives, so the processes can no
        longer agree on the next one. The followers are told to exit and the leader's caller gives up too."""
        reason = "a step failed and multi-host serving does not recover from that"
        self.fail_followers(reason)
        raise LeaderFailedError(reason)


def _encode(batch: StepBatch) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **{k: np.asarray(v) for k, v in vars(batch).items() if v is not None})  # None: a field not in use
    return buf.getvalue()


def _decode(data: bytes) -> StepBatch:
    with np.load(io.BytesIO(data)) as arrays:
        return StepBatch(**{k: arrays[k] for k in arrays.files})
