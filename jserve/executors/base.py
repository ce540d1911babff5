"""The executor interface: what the engine asks of whatever runs the model.

An executor holds the model's parameters and the paged KV cache on their devices, turns a scheduled step into padded
device arrays, runs it and returns sampled tokens: one step (`execute`) or a burst of decode steps in one device call
(`execute_burst`). The engine never sees logits, parameters or compiled programs. Two implement it: the XLA executor
(jserve.executors.xla: the Flax model, attention by reference or Pallas, any mesh; what GPUs and TPUs run) and the CPU
layer executor (jserve.executors.cpu_layers: a step's decoder layers in one C++ kernel call).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import NamedTuple

import jax
import numpy as np

from jserve.engine.rejection import SpecStep
from jserve.engine.sampler import SamplerOutput, SamplingMetadata
from jserve.engine.sequence import ScheduledSeq
from jserve.models.batch import StepBatch

# A burst checks each row's first this many stop tokens on the device (one compiled shape); the host checks them all.
STOP_IDS_WIDTH = 8


class PromptLogprobs(NamedTuple):
    """Raw logprobs of each token's successor under that token's logits (rows follow the batch's tokens)."""

    chosen: np.ndarray  # f32[T] logprob of the given next token
    top_ids: np.ndarray  # i32[T, MAX_LOGPROBS]
    top_logprobs: np.ndarray  # f32[T, MAX_LOGPROBS]
    ranks: np.ndarray  # i32[T] vocabulary rank of the given next token (1 = most likely), as SamplerOutput.ranks


@dataclass
class StepOutput:
    sampled: SamplerOutput  # on the device; rows past the scheduled sequences are padding
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class WarmupReport:
    step_shapes: int
    burst_shapes: int


class Executor(ABC):
    """Runs the model for one engine. Every step's shapes come from a small bucket grid, so after `warmup` nothing
    compiles."""

    name: str  # what `executor` in EngineConfig calls it
    token_buckets: list[int]  # padded token counts a step may have
    supports_burst: bool  # execute_burst is available

    @abstractmethod
    def prepare(self, chunks: Seq[ScheduledSeq], all_logits: bool = False, lookahead: int = 0,
                num_tokens_bucket: int | None = None) -> StepBatch:
        """The scheduled chunks as one padded ragged batch (host arrays). all_logits: the step's logits cover every
        token (prompt logprobs); lookahead: tokens past this step the page table must reach (a burst's later steps);
        num_tokens_bucket: pad to at least this many tokens."""

    @abstractmethod
    def execute(self, batch: StepBatch, meta: SamplingMetadata | Callable[[], SamplingMetadata],
                prompt_next_ids: np.ndarray | None = None, spec: SpecStep | None = None) -> StepOutput:
        """Run one step and sample one token per sequence row. With prompt_next_ids (i32[T], the batch prepared with
        all_logits) also the logprob of each token's successor. With spec (a step whose chunks carry draft tokens)
        every logits row's token comes from the rejection sampler (jserve.engine.rejection): -1 past a sequence's
        first non-accepted row. `meta` may be a function that makes the metadata:
        it is called once the forward is dispatched, so its host work (structured-output masks) overlaps the
        device's."""

    @abstractmethod
    def execute_burst(self, batch: StepBatch, meta: SamplingMetadata, num_steps: int, max_steps: int,
                      stop_ids: np.ndarray | None = None) -> jax.Array:
        """Run a decode-only batch up to num_steps (<= max_steps, the compiled bound) steps in one device call, fewer
        once every row has sampled one of its stop_ids (i32[S, STOP_IDS_WIDTH], -1 padding) -> sampled ids
        i32[max_steps, S] on the device (rows of steps not run are -1)."""

    @abstractmethod
    def warmup(self, decode_burst: int, speculative: bool = False, draft_probs: bool = False) -> WarmupReport:
        """Compile every step shape, decode burst and sampler variant a step can need (with speculative, also the
        speculative steps' logits rows and rejection sampler; with draft_probs, the sampler's variant that takes a
        draft model's distributions)."""

    @abstractmethod
    def seq_rows_for(self, num_tokens_bucket: int) -> int:
        """Sequence rows of a step padded to this many tokens."""


def no_stop_ids(rows: int) -> np.ndarray:
    """A burst's stop ids for rows that never end it early: i32[rows, STOP_IDS_WIDTH] of -1."""
    return np.full((rows, STOP_IDS_WIDTH), -1, np.int32)


def pow2_buckets(smallest: int, largest: int) -> list[int]:
    """Powers of two from `smallest` up to the first one >= `largest`, the last clipped to `largest`."""
    buckets, size = [], smallest
    while size < largest:
        buckets.append(size)
        size *= 2
    buckets.append(largest)
    return buckets


def pick_bucket(buckets: list[int], n: int) -> int:
    for size in buckets:
        if size >= n:
            return size
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
