"""One generation stream: its tokens, its KV blocks and where it is in its life."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from jserve.sampling_params import SamplingParams

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not yet scheduled, or preempted and waiting to be recomputed
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A prompt plus the tokens generated for it so far.

    `num_computed_tokens` counts the leading tokens whose K/V sit in the cache; the tokens after it are what
    the next steps must compute. A request with n > 1 owns n sequences that share `request_id`.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 *, index: int = 0, priority: int = 0, arrival_time: float | None = None):
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache when first scheduled
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.sampling_seed: int | None = None  # the engine's seed for this sequence's draws
        self.sampling_row = None  # the sampler's cache of the fixed per-row parameters (sampler.SamplingRow)
        self.burst_stop_ids: list[int] | None = None  # the engine's cache of the tokens that end it (bursts)
        self.grammar = None  # constrained decoding: this sequence's matcher (engine.structured.SequenceGrammar)
        # A draft model's K/V of this sequence (jserve.engine.draft_model): positions [0, draft_computed) hold its
        # tokens; draft_tail lists what the last round wrote from there on, valid as far as it matches the tokens.
        self.draft_computed = 0
        self.draft_tail: list[int] = []
        self.lora = None  # the LoRA adapter it runs with (jserve.lora.LoraAdapter), or None
        self.lora_slot = -1  # the executor's slot holding it, from first admission to finish (engine.lora_slots)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, position: int) -> int:
        """token_ids[position], without building token_ids."""
        num_prompt = len(self.prompt_token_ids)
        if position < num_prompt:
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - num_prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, request={self.request_id!r}, status={self.status.value}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, blocks={len(self.block_table)})")


@dataclass
class ScheduledSeq:
    """Compute `seq.token_ids[num_computed_tokens : num_computed_tokens + num_new_tokens]` this step; with draft tokens
    (speculative decoding) the last len(draft_token_ids) of the chunk's tokens are those drafts, verified this step."""

    seq: Sequence
    num_new_tokens: int
    sample: bool  # the chunk reaches the last known token, so its logits yield the next token
    draft_token_ids: list[int] = field(default_factory=list)  # proposed tokens after the last known one
