"""Verifying speculative draft tokens on the device: rejection sampling over a flat ragged layout of logits rows.

A sequence with k draft tokens has k + 1 logits rows in a speculative step (its last known token's and each draft's),
a sequence without drafts one; the rows lie back to back, each row's sequence found by `seg_start` (its first row),
and every row carries its sequence's sampling parameters with its own step count (jserve.engine.speculative expands
the metadata on the host, penalties seeing the drafts before the row). Row j verifies draft j: greedy rows accept it
when it is the processed logits' argmax; sampled rows accept draft x with probability min(1, p(x) / q(x)) (q the
draft's distribution) and otherwise draw from norm(max(p - q, 0)), which leaves every emitted token distributed
exactly as the target model's (Leviathan et al., Chen et al. 2023). For a one-hot q (the n-gram proposer's) that is
p(x) and p without x: the row draws its token from p with sample()'s key and accepts x if it drew x, so a seeded
sequence emits the very tokens it would without speculation. A
sequence emits its rows up to and including the first row that is not an accepted draft (a rejection's replacement
or, after all k accepted, the bonus row's own sample); later rows come back as -1.

The draw of a row without a draft is exactly sample()'s (the key fold_in(key(seed), step), the same processed
logits), so a sequence without drafts samples in a speculative step what it would in a plain one.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jserve.engine.packing import PackedLayout, unpack
from jserve.engine.sampler import (
    SamplerOutput,
    SamplingMetadata,
    _apply_bias,
    _apply_bitmask,
    _apply_filters,
    _apply_penalties,
    _chosen_logprobs,
    _top_logprobs,
    greedy_argmax,
    no_logprobs,
)

Array = jax.Array | np.ndarray

# Folded into a row's key for its acceptance test, so the test's uniform is independent of the row's draw.
_ACCEPT_STREAM = 0x5EC


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecRows:
    """Where each logits row of a speculative step sits: L rows, a bucket (padding rows are one-row sequences)."""

    draft_ids: Array  # i32[L]; the draft token this row's logits verify; -1 where none (a sequence's last row)
    seg_start: Array  # i32[L]; the first row of this row's sequence


@dataclasses.dataclass(frozen=True)
class SpecStep:
    """What an executor needs to verify a speculative step's drafts."""

    rows: SpecRows
    logits_rows: np.ndarray  # i32[L] the batch token each logits row comes from (to pick them from all tokens' logits)
    draft_probs: jax.Array | None = None  # f32[L, V] each draft row's draft distribution; None: one-hot drafts


def chunk_logits_rows(query_start: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
    """The batch tokens whose logits a speculative step samples, chunk after chunk: each chunk's last
    num_drafts[i] + 1 tokens (its last known token and its drafts) -> i32[sum(num_drafts + 1)]."""
    num_rows = num_drafts + 1
    ends = np.asarray(query_start[1:len(num_drafts) + 1], np.int32)
    firsts = np.repeat(ends - num_rows, num_rows)
    starts = np.repeat(np.cumsum(num_rows) - num_rows, num_rows)
    return (firsts + np.arange(int(num_rows.sum())) - starts).astype(np.int32)


def logits_rows_for(num_rows: int, num_tokens_bucket: int, seq_rows: int) -> int:
    """L, the padded logits rows of a speculative step needing num_rows: the step's sequence rows where they hold
    them (every bucket the executors warm up), else one per token (a row never outnumbers the step's tokens)."""
    return seq_rows if num_rows <= seq_rows else num_tokens_bucket


@functools.partial(jax.jit, static_argnums=3)
def rejection_sample(logits: jax.Array, meta: SamplingMetadata, rows: SpecRows,
                     argmax: Callable[[jax.Array], jax.Array] = greedy_argmax,
                     draft_probs: jax.Array | None = None) -> SamplerOutput:
    """Verify the drafts of logits f32[L, V] -> each row's emitted token (-1 past a sequence's first non-accepted
    row), with sample()'s logprobs of that token where meta asks. draft_probs f32[L, V]: the draft's distribution at
    each draft row (None: one-hot drafts, as the n-gram proposer's)."""
    logits = logits.astype(jnp.float32)
    x = _apply_bias(logits, meta.bias_ids, meta.bias_values)
    if meta.needs_penalties:
        x = _apply_penalties(x, meta)
    if meta.token_bitmask.shape[1]:
        x = _apply_bitmask(x, meta.token_bitmask)
    target = argmax(x)
    has_draft = rows.draft_ids >= 0
    accept, token = target == rows.draft_ids, target
    if not meta.all_greedy:
        greedy = meta.temperature == 0
        accept_s, token_s = jax.lax.cond(jnp.all(greedy), lambda: (accept, token),
                                         lambda: _verify_sampled(x, meta, rows.draft_ids, draft_probs))
        accept, token = jnp.where(greedy, accept, accept_s), jnp.where(greedy, token, token_s)
    accept = accept & has_draft
    token = jnp.where(accept, rows.draft_ids, token)
    rejected = (has_draft & ~accept).astype(jnp.int32)
    rejected_before = jnp.cumsum(rejected) - rejected  # rejections in the rows before this one (any sequence)
    reached = rejected_before == rejected_before[rows.seg_start]  # none since this row's sequence began
    token_ids = jnp.where(reached, token, -1)
    if not meta.needs_logprobs:
        return no_logprobs(token_ids)
    lse = jax.nn.logsumexp(logits, axis=-1)
    chosen, ranks = _chosen_logprobs(logits, lse, jnp.maximum(token_ids, 0))
    top_ids, top_logprobs = _top_logprobs(logits, lse, meta.num_logprobs)
    return SamplerOutput(token_ids=token_ids, logprobs=chosen, top_ids=top_ids, top_logprobs=top_logprobs,
                         ranks=ranks)


def _verify_sampled(x: jax.Array, meta: SamplingMetadata, draft_ids: jax.Array,
                    draft_probs: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """-> (whether each row accepts its draft, the token it draws otherwise) under temperature and the filters."""
    temperature = jnp.where(meta.temperature > 0, meta.temperature, 1.0)
    x = x / temperature[:, None]
    if meta.needs_filters:  # as sample(): rows without a filter pass through unchanged
        wanted = jnp.any((meta.top_k > 0) | (meta.top_p < 1.0) | (meta.min_p > 0.0))
        x = jax.lax.cond(wanted, lambda x: _apply_filters(x, meta.top_k, meta.top_p, meta.min_p), lambda x: x, x)
    keys = jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(meta.seeds, meta.steps)
    has_draft = draft_ids >= 0
    draft = jnp.maximum(draft_ids, 0)[:, None]
    if draft_probs is None:
        # One-hot q: draw the row's token from p exactly as sample() would and accept the draft if it is that token.
        # That accepts with probability p(x) and otherwise yields p without x, renormalised (the rule for a one-hot
        # q), and a seeded sequence gets the tokens it gets without speculation, whatever was drafted.
        token = jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32)
        return token == draft[:, 0], token
    probs = jax.nn.softmax(x, axis=-1)
    p = jnp.take_along_axis(probs, draft, axis=-1)[:, 0]
    q = jnp.take_along_axis(draft_probs, draft, axis=-1)[:, 0]
    residual = jnp.log(jnp.maximum(probs - draft_probs, 0.0))
    # A residual with no mass is only reached with probability 0 (p = q); the target keeps the draw defined.
    residual = jnp.where(has_draft[:, None] & jnp.any(residual > -jnp.inf, axis=-1, keepdims=True), residual, x)
    u = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, _ACCEPT_STREAM)))(keys)
    accept = u * q < p  # u < p / q without dividing by a zero q
    token = jax.vmap(jax.random.categorical)(keys, residual).astype(jnp.int32)
    return accept, token


@functools.partial(jax.jit, static_argnums=(2, 3))
def rejection_sample_packed(logits: jax.Array, packed: jax.Array, layout: PackedLayout,
                            argmax: Callable[[jax.Array], jax.Array] = greedy_argmax,
                            draft_probs: jax.Array | None = None) -> SamplerOutput:
    """rejection_sample() with (meta, rows) packed by jserve.engine.packing.pack: one transfer."""
    meta, rows = unpack(packed, layout)
    return rejection_sample(logits, meta, rows, argmax, draft_probs)
