"""Speculative decoding, host side: proposers of draft tokens, and a speculative step's logits-row layout.

A proposer guesses up to k tokens that follow a decoding sequence; the scheduler schedules the sequence's last known
token and those drafts as k + 1 query tokens of the ordinary ragged batch, so one forward computes the target
model's logits at every draft position, and jserve.engine.rejection accepts the longest run the target agrees with
plus one token of its own. docs/speculative.md tells how it fits together.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from jserve.config import SpeculativeConfig
from jserve.engine.rejection import SpecRows, SpecStep, chunk_logits_rows
from jserve.engine.sampler import SamplingMetadata, pow2_bucket
from jserve.engine.sequence import ScheduledSeq, Sequence

_HISTORY_FLOOR = 16  # as the sampler's: short histories share one compiled shape


class Proposer:
    """What proposes draft tokens: the n-gram lookup here, a draft model (jserve.engine.draft_model); an EAGLE-style
    head would be a third. The scheduler asks once a step, for every decoding sequence that may speculate."""

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        """For each (sequence, k >= 1): up to k tokens guessed to follow the sequence's tokens ([] for no guess)."""
        raise NotImplementedError

    def draft_probs(self, chunks: list[ScheduledSeq], layout: SpecLayout) -> jax.Array | None:
        """f32[L, V]: the distribution each draft row's token was drawn from, in the verifying step's logits-row
        layout (rows without a draft: anything); None for one-hot drafts (a deterministic proposer's)."""
        return None

    def warmup(self, logits_rows: list[int]) -> int:
        """Compile what proposing can need (a draft model's steps), for verifying steps of these logits rows ->
        the model step shapes compiled."""
        return 0

    def reset(self) -> None:
        """Forget device state (the engine's recovery after a failed step)."""


class NgramProposer(Proposer):
    """Prompt lookup: find the sequence's last n tokens (n from max_n down to min_n, the longest that matches wins)
    earlier in its prompt and output, and propose the tokens that followed its first occurrence (as transformers'
    prompt lookup: in text that repeats with a short period the first occurrence has the most tokens after it)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        return [ngram_lookup(np.asarray(seq.token_ids, np.int64), self.min_n, self.max_n, k).tolist()
                for seq, k in requests]


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """The up-to-k tokens after the first occurrence of tokens' last n tokens, for the largest n in
    [min_n, max_n] that occurs (an occurrence must be followed by at least one token); empty if none does."""
    num = len(tokens)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        # windows[i] = tokens[i : i + n] for every start whose window ends before the last token
        windows = sliding_window_view(tokens[:num - 1], n)
        hits = np.flatnonzero((windows == tokens[num - n:]).all(axis=1))
        if len(hits):
            start = hits[0] + n
            return tokens[start: start + k]
    return tokens[:0]


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer of a method that needs no model (a draft model's is jserve.engine.draft_model's)."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"speculative_config.method {config.method!r} needs a model: see jserve.engine.draft_model")


@dataclasses.dataclass
class SpecLayout:
    """A speculative step's logits rows on the host: chunk i owns rows [row_start[i], row_start[i] + num_rows[i])."""

    rows: SpecRows  # what the device's rejection sampler takes
    row_seq: np.ndarray  # i32[L] each row's sequence (len(chunks) for padding rows)
    row_offset: np.ndarray  # i32[L] each row's index in its sequence's rows (its draft's index)
    row_start: np.ndarray  # i32[len(chunks)]
    num_rows: np.ndarray  # i32[len(chunks)]
    logits_rows: np.ndarray  # i32[L] the batch token each row's logits come from (for an all-token step)

    def step(self, draft_probs: jax.Array | None = None) -> SpecStep:
        return SpecStep(self.rows, self.logits_rows, draft_probs)


def spec_layout(chunks: list[ScheduledSeq], query_start: np.ndarray, num_logits_rows: int) -> SpecLayout:
    """The rows of each chunk (its drafts + 1, back to back) padded to num_logits_rows, vectorised over rows."""
    num_drafts = np.array([len(c.draft_token_ids) for c in chunks], np.int32)
    num_rows = num_drafts + 1
    row_start = np.concatenate([[0], np.cumsum(num_rows)[:-1]]).astype(np.int32)
    total = int(num_rows.sum())
    padding = num_logits_rows - total
    row_seq = np.concatenate([np.repeat(np.arange(len(chunks), dtype=np.int32), num_rows),
                              np.full(padding, len(chunks), np.int32)])
    seg_start = np.concatenate([np.repeat(row_start, num_rows), np.arange(total, num_logits_rows, dtype=np.int32)])
    row_offset = np.arange(num_logits_rows, dtype=np.int32) - seg_start
    draft_ids = np.full(num_logits_rows, -1, np.int32)
    drafted = [c.draft_token_ids for c in chunks if c.draft_token_ids]
    if drafted:
        draft_rows = np.concatenate([start + np.arange(d) for start, d in zip(row_start, num_drafts, strict=True)])
        draft_ids[draft_rows] = np.concatenate(drafted)
    logits_rows = np.zeros(num_logits_rows, np.int32)
    logits_rows[:total] = chunk_logits_rows(query_start, num_drafts)
    return SpecLayout(SpecRows(draft_ids=draft_ids, seg_start=seg_start.astype(np.int32)), row_seq, row_offset,
                      row_start, num_rows, logits_rows)


def expand_metadata(meta: SamplingMetadata, layout: SpecLayout, chunks: list[ScheduledSeq]) -> SamplingMetadata:
    """meta (a row per chunk, then at least one padding row) as one row per logits row: each row its sequence's
    parameters, its step count advanced by its offset (its own draw), and under a penalty the drafts before it in its
    history (the tokens accepted before its position, if it is reached at all)."""
    take = layout.row_seq
    fields = {f.name: np.asarray(getattr(meta, f.name))[take] for f in dataclasses.fields(meta)
              if not f.metadata.get("static")}
    fields["steps"] = fields["steps"] + layout.row_offset
    history = np.asarray(meta.history_ids)
    max_drafts = int(layout.num_rows.max()) - 1
    if history.shape[1] and max_drafts:
        lengths = (history >= 0).sum(axis=1)[take]  # a row's history is contiguous, then -1 padding
        drafts = np.full((len(chunks) + 1, max_drafts), -1, np.int32)
        for i, chunk in enumerate(chunks):
            drafts[i, :len(chunk.draft_token_ids)] = chunk.draft_token_ids
        width = pow2_bucket(history.shape[1] + max_drafts, _HISTORY_FLOOR)
        expanded = np.full((len(take), width), -1, np.int32)
        expanded[:, :history.shape[1]] = fields["history_ids"]
        cols = np.arange(max_drafts)
        before = cols[None, :] < layout.row_offset[:, None]  # the drafts before each row
        rows, j = np.nonzero(before)
        expanded[rows, lengths[rows] + j] = drafts[take[rows], j]
        fields["history_ids"] = expanded
    return dataclasses.replace(meta, **fields)


def split_rows(tokens: np.ndarray, layout: SpecLayout) -> list[list[int]]:
    """Each chunk's emitted tokens: its rows up to the first -1."""
    out = []
    for start, count in zip(layout.row_start.tolist(), layout.num_rows.tolist(), strict=True):
        row = tokens[start: start + count]
        out.append(row[:int(np.count_nonzero(row >= 0))].tolist())
    return out
