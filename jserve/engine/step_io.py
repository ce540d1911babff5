"""What a step hands the executor beside its batch, and what it reads back per row: the tokens that end a burst
early, the next prompt tokens whose logprobs are asked for, and the sampler's logprob rows."""

from __future__ import annotations

import numpy as np

from jserve.engine.scheduler import SchedulerOutput
from jserve.engine.sequence import ScheduledSeq, Sequence
from jserve.executors.base import STOP_IDS_WIDTH, no_stop_ids


def wants_prompt_logprobs(chunk: ScheduledSeq) -> bool:
    """Whether the chunk computes prompt tokens whose successors' logprobs its request asks for."""
    seq = chunk.seq
    return seq.params.prompt_logprobs is not None and seq.num_computed_tokens < seq.num_prompt_tokens - 1


def prompt_next_ids(plan: SchedulerOutput, wanted: list[bool], query_start: np.ndarray,
                    num_tokens: int) -> np.ndarray:
    """i32[T]: the token after each batch token in its sequence, for the chunks that want prompt logprobs."""
    next_ids = np.zeros(num_tokens, np.int32)
    for row, chunk in enumerate(plan.scheduled):
        if wanted[row]:
            start, seq = query_start[row], chunk.seq
            tokens = seq.token_ids[seq.num_computed_tokens + 1: seq.num_computed_tokens + chunk.num_new_tokens + 1]
            next_ids[start: start + len(tokens)] = tokens
    return next_ids


def burst_stop_ids(seqs: list[Sequence], rows: int) -> np.ndarray:
    """i32[rows, STOP_IDS_WIDTH]: the tokens that end each sequence (its EOS ids unless ignore_eos, then its
    stop_token_ids; the first STOP_IDS_WIDTH, -1 padding), for a burst to end on the device once all have ended."""
    stop_ids = no_stop_ids(rows)
    for row, seq in enumerate(seqs):
        ids = seq.burst_stop_ids
        if ids is None:  # the same every burst: built once per sequence
            params = seq.params
            ids = ([] if params.ignore_eos else list(params.eos_token_ids)) + list(params.stop_token_ids)
            ids = seq.burst_stop_ids = ids[:STOP_IDS_WIDTH]
        stop_ids[row, :len(ids)] = ids
    return stop_ids


def logprob_rows(sampled) -> list[tuple[float, list[int], list[float], int]]:
    """Per sampler row: (the chosen token's logprob, the top ids, their logprobs, the chosen token's rank)."""
    chosen = np.asarray(sampled.logprobs).tolist()
    top_ids = np.asarray(sampled.top_ids).tolist()
    top_lps = np.asarray(sampled.top_logprobs).tolist()
    ranks = np.asarray(sampled.ranks).tolist()
    return list(zip(chosen, top_ids, top_lps, ranks, strict=True))
