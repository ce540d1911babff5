"""Continuous batching: each step, pick which sequences compute how many tokens under the step's budgets.

Like vLLM v1 there is no separate prefill or decode phase: a sequence simply has tokens it has not computed
yet (a whole prompt, a prompt chunk, one decoded token, or everything again after a preemption) and the
scheduler hands out a token budget. Running sequences are served first, in precedence order, so decodes are
never starved by new prompts; waiting sequences are then admitted in order while tokens, seats and
blocks last.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from jserve.config import EngineConfig
from jserve.engine.kv_cache import BlockManager
from jserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    """Compute `seq.token_ids[num_computed_tokens : num_computed_tokens + num_new_tokens]` this step."""

    seq: Sequence
    num_new_tokens: int
    sample: bool  # the chunk reaches the last known token, so its logits yield the next token


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def precedence(seq: Sequence) -> tuple[int, float, int]:
    """Sort key: lower comes first; the largest key is the first to be preempted."""
    return (seq.priority, seq.arrival_time, seq.seq_id)


class Scheduler:
    """Owns the waiting and running queues. Each step: schedule(), run the model, on_step_done()."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int):
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.enable_chunked_prefill = config.enable_chunked_prefill
        # Both queues stay sorted by precedence, so the preemption victim is always running[-1].
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ----- queues -----

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; ValueError if it could never be served, whatever else is running."""
        self.check_fits(seq)
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=precedence)

    def check_fits(self, seq: Sequence) -> None:
        """Raise ValueError if the sequence could never be scheduled (add calls this; so may engines)."""
        bm = self.block_manager
        limit = max(self.max_model_len, seq.num_tokens)  # the engine enforces max_model_len; stay safe anyway
        max_tokens = seq.params.max_tokens
        total = limit if max_tokens is None else min(seq.num_tokens + max_tokens, limit)
        # The last sampled token is never fed back, so at most total - 1 positions need K/V.
        if bm.num_blocks_for(total - 1) > bm.num_blocks:
            raise ValueError(
                f"request {seq.request_id!r} needs up to {total - 1} tokens of KV cache but the cache holds "
                f"{bm.num_blocks * bm.block_size} ({bm.num_blocks} blocks of {bm.block_size}); "
                f"lower max_tokens or give the KV cache more memory")
        if not self.enable_chunked_prefill and seq.num_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"request {seq.request_id!r} has a {seq.num_tokens}-token prompt but max_num_batched_tokens "
                f"is {self.max_num_batched_tokens} and chunked prefill is off")

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of the request, waiting or running, with finish_reason "abort"."""
        seqs = [s for s in self.waiting + self.running if s.request_id == request_id]
        for seq in seqs:
            self.finish(seq, "abort")
        return seqs

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence and release its blocks (their prefixes stay cached)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table:
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # ----- scheduling -----

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:  # admitting now would only steal the blocks a preemption just freed
            budget = self._schedule_waiting(out, budget)
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        if out.is_empty and self.has_unfinished():
            raise RuntimeError(
                f"no sequence fits in the KV cache ({self.block_manager.num_blocks} blocks of "
                f"{self.block_manager.block_size} tokens): {self.running or self.waiting[:1]}")
        return out

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """How many of the sequence's uncomputed tokens to compute now (0: not this step)."""
        remaining = seq.num_tokens - seq.num_computed_tokens
        num_new = min(remaining, budget)
        # Without chunked prefill a prompt goes whole or waits; only a recompute after preemption that could
        # never fit in one step is split.
        if not self.enable_chunked_prefill and num_new < remaining <= self.max_num_batched_tokens:
            return 0
        return num_new

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = self._chunk(seq, budget)
            if num_new == 0:
                i += 1
                continue
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = self.running[-1]  # lowest precedence: the newest request
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    return budget
            out.scheduled.append(self._scheduled(seq, num_new))
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self._sibling_prefilling(seq):
                break  # wait one step: once the sibling's prompt is cached, this sample reuses its blocks
            bm.allocate_prefix(seq)  # cached blocks shrink the work, so look them up before sizing the chunk
            num_new = self._chunk(seq, budget)
            if num_new == 0 or not bm.allocate_slots(seq, num_new):
                bm.cancel_prefix(seq)
                break  # no skipping ahead: later requests must not overtake the head forever
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=precedence)
            out.scheduled.append(self._scheduled(seq, num_new))
            budget -= num_new
        return budget

    def _sibling_prefilling(self, seq: Sequence) -> bool:
        """An n > 1 sample whose sibling is still computing the shared prompt (only matters with prefix caching)."""
        if seq.index == 0 or not self.block_manager.enable_prefix_caching or seq.num_computed_tokens:
            return False
        return any(s.request_id == seq.request_id and s.num_computed_tokens < s.num_prompt_tokens
                   for s in self.running)

    @staticmethod
    def _scheduled(seq: Sequence, num_new: int) -> ScheduledSeq:
        return ScheduledSeq(seq, num_new, sample=seq.num_computed_tokens + num_new == seq.num_tokens)

    def _preempt(self, seq: Sequence) -> None:
        # Preempt by recompute: drop the K/V; the prefix cache usually gives most of it back on readmission.
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=precedence)

    def on_step_done(self, output: SchedulerOutput) -> None:
        """The model ran the step: advance each sequence past the tokens it computed."""
        for item in output.scheduled:
            if not item.seq.is_finished:  # aborted while the step ran; its blocks are already gone
                self.block_manager.mark_computed(item.seq, item.num_new_tokens)
