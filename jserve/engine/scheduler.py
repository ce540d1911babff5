"""Continuous batching: each step, pick which sequences compute how many tokens under the step's budgets.

Like vLLM v1 there is no separate prefill or decode phase: a sequence simply has tokens it has not computed
yet (a whole prompt, a prompt chunk, one decoded token, or everything again after a preemption) and the
scheduler hands out a token budget. Running sequences are served first, in precedence order, so decodes are
never starved by new prompts; waiting sequences are then admitted in order while tokens, seats and
blocks last. When every scheduled sequence is decoding, it also decides how many decode steps the executor runs in
one device call (a burst), and allocates their slots. With speculative decoding a decoding sequence may also carry
draft tokens from the proposer, computed (verified) as extra query tokens of the step; those steps never burst, and
a sequence advances only past the drafts the sampler accepted. It alone allocates blocks and advances what is
computed.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from jserve.config import EngineConfig
from jserve.engine.kv_cache import BlockManager
from jserve.engine.lora_slots import LoraSlots
from jserve.engine.sampler import has_dynamic_bias, has_penalty
from jserve.engine.sequence import ScheduledSeq, Sequence, SequenceStatus
from jserve.engine.speculative import Proposer
from jserve.sampling_params import RequestOutputKind


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0
    burst: int = 0  # decode steps in one device call (every scheduled chunk a decode); 0: one plain step
    burst_bucket: int = 0  # the padded batch size the burst runs at (its step time is recorded by it)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def precedence(seq: Sequence) -> tuple[int, float, int]:
    """Sort key: lower comes first; the largest key is the first to be preempted."""
    return (seq.priority, seq.arrival_time, seq.seq_id)


class Scheduler:
    """Owns the waiting and running queues. Each step: schedule(), run the model, update()."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int,
                 burst_buckets: list[int] | None = None, proposer: Proposer | None = None,
                 lora_slots: LoraSlots | None = None):
        """burst_buckets: the padded batch sizes the executor's decode bursts run at (None: no bursts); proposer:
        what proposes draft tokens (speculative decoding; config.speculative_config bounds how many); lora_slots: the
        executor's LoRA adapter slots (enable_lora), which a sequence must hold a slot of to be admitted."""
        self.lora_slots = lora_slots
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.decode_burst, self.decode_burst_ms = config.decode_burst, config.decode_burst_ms
        self.burst_buckets = burst_buckets
        self.decode_step_seconds: dict[int, float] = {}  # the last burst's time a step, by batch bucket
        spec = config.speculative_config
        self.proposer = proposer if spec is not None else None
        self.num_speculative_tokens = spec.num_speculative_tokens if spec is not None else 0
        self.disable_spec_batch_size = spec.disable_by_batch_size if spec is not None else None
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
        if self.lora_slots is not None:
            self.lora_slots.release(seq)
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
        if out.scheduled and self.burst_buckets is not None:
            out.burst = self._burst_length(out)
            if out.burst:
                out.burst_bucket = next(b for b in self.burst_buckets if b >= len(out.scheduled))
            for chunk in out.scheduled if out.burst > 1 else ():  # each holds the first step's slot already
                allocated = self.block_manager.allocate_slots(chunk.seq, out.burst)
                assert allocated, "_burst_length checked the free blocks"
        return out

    def _burst_length(self, out: SchedulerOutput) -> int:
        """How many decode steps to run in one fused forward-and-sample device call; 0: this step needs the plain
        forward and sampler (a prompt chunk; logprobs, which are per step; penalties and a pending min_tokens, which
        change the sampling metadata every step, as do bad words of several tokens; a constraint, whose token mask
        the host computes each step).

        Up to decode_burst steps when no request waits, nor past any sequence's max_tokens or max_model_len,
        halved until the free blocks hold their slots; while any request streams (not FINAL_ONLY), no more than fit
        in decode_burst_ms at the last measured step time for this batch size."""
        length, streaming = self.decode_burst, False
        for chunk in out.scheduled:
            seq, params = chunk.seq, chunk.seq.params
            if not _is_decode(chunk):
                return 0  # a prompt token (a one-token prompt's only step): not a decode
            if params.logprobs is not None or has_penalty(params) or seq.num_output_tokens < params.min_tokens \
                    or has_dynamic_bias(params):
                return 0
            if seq.grammar is not None:  # its mask comes from the host, one step at a time
                return 0
            length = min(length, params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
            streaming = streaming or params.output_kind is not RequestOutputKind.FINAL_ONLY
        if self.waiting:
            return 1
        if streaming:  # the time budget bounds how long a burst holds back streamed tokens
            bucket = next(b for b in self.burst_buckets if b >= len(out.scheduled))
            step_seconds = self.decode_step_seconds.get(bucket)
            if step_seconds is None:
                return 1  # this batch size's first decode step runs alone, and is timed
            fits = self.decode_burst_ms / 1e3 / max(step_seconds, 1e-9)  # inf: no time limit
            length = length if fits >= length else max(1, int(fits))
        bm = self.block_manager
        while length > 1 and sum(bm.num_new_blocks(chunk.seq, length) for chunk in out.scheduled) > \
                bm.num_free_blocks:
            length //= 2  # a shorter burst whose slots fit the free blocks
        return max(length, 1)

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
        limit = self.disable_spec_batch_size
        speculate = self.proposer is not None and (limit is None or len(self.running) <= limit)
        drafting: list[tuple[ScheduledSeq, int]] = []  # decodes holding slots for k drafts, proposed below
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = self._chunk(seq, budget)
            if num_new == 0:
                i += 1
                continue
            k = self._draft_limit(seq, budget) if speculate and num_new == 1 else 0
            # Drafts only take free blocks: a sequence that cannot get their slots decodes plainly instead.
            if k and self.block_manager.allocate_slots(seq, 1 + k):
                chunk = ScheduledSeq(seq, 1 + k, sample=True)
                out.scheduled.append(chunk)
                drafting.append((chunk, k))
                budget -= 1 + k
                i += 1
                continue
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = self.running[-1]  # lowest precedence: the newest request
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    return budget + self._propose(drafting)
            out.scheduled.append(self._scheduled(seq, num_new))
            budget -= num_new
            i += 1
        return budget + self._propose(drafting)

    def _draft_limit(self, seq: Sequence, budget: int) -> int:
        """How many draft tokens a decoding sequence may carry: none for a constrained one (its token masks come one
        step at a time) or one with min_tokens pending (its EOS ban lifts mid-draft); never past the step's budget,
        its max_tokens or max_model_len (the token after the last draft is always emitted too); none for one with a
        bad word of several tokens either (its ban depends on the tokens before it, drafts included)."""
        params = seq.params
        if seq.num_output_tokens == 0 or seq.num_computed_tokens != seq.num_tokens - 1 or seq.grammar is not None \
                or seq.num_output_tokens < params.min_tokens or has_dynamic_bias(params):
            return 0
        return max(0, min(self.num_speculative_tokens, budget - 1, params.max_tokens - seq.num_output_tokens - 1,
                          self.max_model_len - seq.num_tokens - 1))

    def _propose(self, drafting: list[tuple[ScheduledSeq, int]]) -> int:
        """Ask the proposer for every drafting decode at once (a draft model runs them as one batch) and shrink each
        chunk to the drafts it got, giving back the blocks and budget of the rest -> the budget given back."""
        if not drafting:
            return 0
        proposals = self.proposer.propose([(chunk.seq, k) for chunk, k in drafting])
        returned = 0
        for (chunk, k), drafts in zip(drafting, proposals, strict=True):
            chunk.draft_token_ids = list(drafts)[:k]
            returned += k - len(chunk.draft_token_ids)
            chunk.num_new_tokens = 1 + len(chunk.draft_token_ids)
            self.block_manager.trim(chunk.seq, chunk.seq.num_computed_tokens + chunk.num_new_tokens)
        return returned

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self._sibling_prefilling(seq):
                break  # wait one step: once the sibling's prompt is cached, this sample reuses its blocks
            if self.lora_slots is not None and not self.lora_slots.acquire(seq):
                break  # every adapter slot is held by running sequences of other adapters: wait for one to finish
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

    def update(self, output: SchedulerOutput, appended: list[int], finished: list[tuple[Sequence, str]],
               step_seconds: float | None = None) -> None:
        """The model ran the step: advance each sequence past the tokens it computed, then retire the ones that
        ended. appended: tokens each chunk's sequence took from the step (a burst computes one more token of a
        sequence for each it appended, and so does a chunk with drafts: its last known token and the drafts accepted);
        step_seconds: a burst's time a step, which bounds later bursts."""
        bm = self.block_manager
        for chunk, count in zip(output.scheduled, appended, strict=True):
            seq = chunk.seq
            if seq.is_finished:  # aborted while the step ran; its blocks are already gone
                continue
            if not chunk.draft_token_ids:
                bm.mark_computed(seq, count if output.burst else chunk.num_new_tokens)
                continue
            # The K/V of rejected drafts is left to be overwritten: the sequence is computed only as far as its
            # accepted tokens (so only they are hashed into the prefix cache), and blocks that held nothing but
            # rejected drafts go back (the next step's own token needs num_tokens positions).
            bm.mark_computed(seq, count)
            bm.trim(seq, seq.num_tokens)
        for seq, reason in finished:
            self.finish(seq, reason)
        if output.burst and step_seconds is not None:
            self.decode_step_seconds[output.burst_bucket] = step_seconds


def _is_decode(chunk: ScheduledSeq) -> bool:
    """Whether a scheduled chunk is one sampled token after the whole prompt (a decode step)."""
    seq = chunk.seq
    return chunk.num_new_tokens == 1 and chunk.sample and seq.num_computed_tokens >= seq.num_prompt_tokens
