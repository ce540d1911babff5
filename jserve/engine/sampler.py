"""Token sampling for a padded batch: per-request parameters live in arrays so one jitted call mixes them.

The order follows vLLM (v1): the returned logprobs come from the model's raw logits; then logit bias (with
allowed_token_ids and bad_words), penalties (repetition, frequency, presence), temperature, min-p, top-k, top-p
over what min-p and top-k keep, and one draw per row from that row's
own PRNG key, fold_in(key(seed), step), so a seeded request gets the same tokens whatever shares its batch.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jserve.engine.packing import PackedLayout, unpack
from jserve.engine.sequence import Sequence
from jserve.sampling_params import MAX_LOGPROBS, SamplingParams

Array = jax.Array | np.ndarray

# Temperatures below this are greedy (as in vLLM): dividing by them would overflow the logits.
GREEDY_EPS = 1e-5
_HISTORY_FLOOR = 16  # smallest history width, so short histories share one compiled shape
_BIAS_FLOOR = 4
_MASK64 = (1 << 64) - 1
_NO_DRAW = (0.0, 0, 1.0, 0.0)  # temperature, top_k, top_p, min_p of a greedy or padded row


def _static(default: Any) -> Any:
    # A dataclass field that jit treats as static (part of the tree structure): changing it recompiles.
    return dataclasses.field(default=default, metadata={"static": True})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling parameters; S is the padded batch (a bucket) and padded rows are greedy no-ops."""

    temperature: Array  # f32[S]; 0 = greedy
    top_k: Array  # i32[S]; 0 = off
    top_p: Array  # f32[S]; 1 = off
    min_p: Array  # f32[S]; 0 = off
    repetition_penalty: Array  # f32[S]; 1 = off
    presence_penalty: Array  # f32[S]; 0 = off
    frequency_penalty: Array  # f32[S]; 0 = off
    seeds: Array  # u32[S]; the row's PRNG seed
    steps: Array  # i32[S]; tokens generated so far, folded into the row's key
    # i32[S, M]; prompt (kept only under a repetition penalty) then output token ids, -1 padding;
    # M = 0 when no row has a penalty
    history_ids: Array
    num_prompt: Array  # i32[S]; how many leading history_ids are prompt tokens
    bias_ids: Array  # i32[S, B]; sparse logit-bias token ids, -1 padding
    bias_values: Array  # f32[S, B]; added to the logits of bias_ids (-inf forbids the token)
    # i32[S, W]; bit v % 32 of word v // 32 allows token v (constrained decoding; unconstrained rows all ones);
    # W = 0 when no row is constrained
    token_bitmask: Array
    all_greedy: bool = _static(True)  # every row greedy: skip temperature, filters and the draw
    needs_penalties: bool = _static(False)  # some row has a penalty and a non-empty history
    needs_filters: bool = _static(False)  # some sampled row uses top-k, top-p or min-p (costs a sort)
    num_logprobs: int = _static(0)  # K of the top-K logprobs returned: 0 or MAX_LOGPROBS
    needs_logprobs: bool = _static(False)  # some row wants logprobs (else they are not computed: zeros)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    token_ids: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S]; raw logprob (log_softmax of the model's logits) of the chosen token
    top_ids: jax.Array  # i32[S, K]; the K most likely tokens under the raw logits, most likely first
    top_logprobs: jax.Array  # f32[S, K]
    # i32[S]; vocabulary rank of the chosen token under the raw logprobs: how many tokens have a logprob >= its own
    # (1 for the most likely), as vLLM's; zeros where logprobs are not computed
    ranks: jax.Array


# ----------------------------------------------------------------------------------------------- host side


def hash_seed(seed: int) -> int:
    """Map any seed in [-2**63, 2**64) to a uint32 deterministically; 32-bit seeds map to themselves."""
    if 0 <= seed < 1 << 32:
        return seed
    x = (seed & _MASK64) + 0x9E3779B97F4A7C15  # splitmix64 finalizer, so nearby 64-bit seeds spread out
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return (x ^ (x >> 32)) & 0xFFFFFFFF


def pow2_bucket(n: int, floor: int = 1) -> int:
    """0 for 0, else the smallest power of two >= max(n, floor)."""
    return 0 if n <= 0 else max(floor, 1 << (n - 1).bit_length())


def build_metadata(seqs: list[Sequence], pad_to: int,
                   history_bucket: Callable[[int], int] | None = None) -> SamplingMetadata:
    """Gather the batch's sampling parameters into padded numpy arrays (rows past len(seqs) are no-ops).

    history_bucket maps the widest needed history to the padded width M (default: a power of two >= 16).
    """
    if pad_to < len(seqs):
        raise ValueError(f"pad_to ({pad_to}) is smaller than the batch ({len(seqs)})")
    rows = [_sampling_row(seq) for seq in seqs]
    columns = np.array([r.values for r in rows], np.float64).reshape(len(rows), len(_ROW_FILL))
    padded = np.tile(np.array(_ROW_FILL, np.float64), (pad_to, 1))
    padded[:len(rows)] = columns
    history_ids, num_prompt = _history([(i, seq) for i, (seq, r) in enumerate(zip(seqs, rows, strict=True))
                                        if r.has_penalty], pad_to, history_bucket or _default_history_bucket)
    bias_ids, bias_values = _bias([(i, seq) for i, (seq, r) in enumerate(zip(seqs, rows, strict=True))
                                   if r.has_bias or seq.num_output_tokens < seq.params.min_tokens], pad_to)
    steps = np.zeros(pad_to, np.int32)
    steps[:len(seqs)] = [seq.num_output_tokens for seq in seqs]
    return SamplingMetadata(
        temperature=padded[:, 0].astype(np.float32),
        top_k=padded[:, 1].astype(np.int32),
        top_p=padded[:, 2].astype(np.float32),
        min_p=padded[:, 3].astype(np.float32),
        repetition_penalty=padded[:, 4].astype(np.float32),
        presence_penalty=padded[:, 5].astype(np.float32),
        frequency_penalty=padded[:, 6].astype(np.float32),
        seeds=padded[:, 7].astype(np.uint32),
        steps=steps,
        history_ids=history_ids,
        num_prompt=num_prompt,
        bias_ids=bias_ids,
        bias_values=bias_values,
        token_bitmask=np.zeros((pad_to, 0), np.int32),
        all_greedy=all(r.values[0] == 0.0 for r in rows),
        needs_penalties=history_ids.shape[1] > 0,
        needs_filters=any(r.has_filter for r in rows),
        num_logprobs=MAX_LOGPROBS if any(seq.params.logprobs for seq in seqs) else 0,
        needs_logprobs=any(seq.params.logprobs is not None for seq in seqs),
    )


class MetadataCache:
    """build_metadata for consecutive steps of the same sequences, where only `steps` changes: the last batch's
    metadata is kept and its step counts replaced. Rows with a penalty (their history grows) or a pending
    min_tokens (its bias lifts) or a bad word of several tokens (its ban follows the output) change more than
    that, so a batch holding one is never kept."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._meta: SamplingMetadata | None = None

    def build(self, seqs: list[Sequence], pad_to: int) -> SamplingMetadata:
        key = (pad_to, *[seq.seq_id for seq in seqs])
        if key != self._key:
            self._meta = build_metadata(seqs, pad_to)
            fixed = all(not _sampling_row(seq).has_penalty and seq.num_output_tokens >= seq.params.min_tokens
                        and not has_dynamic_bias(seq.params) for seq in seqs)
            self._key = key if fixed else None
            return self._meta
        steps = np.zeros(pad_to, np.int32)
        steps[:len(seqs)] = [seq.num_output_tokens for seq in seqs]
        return dataclasses.replace(self._meta, steps=steps)


# The values of a padded row: greedy, no filter, no penalty, seed 0 (the order of SamplingRow.values).
_ROW_FILL = (*_NO_DRAW, 1.0, 0.0, 0.0, 0)


@dataclasses.dataclass(frozen=True)
class SamplingRow:
    """What a sequence's fixed SamplingParams put in its metadata row, computed once (they never change)."""

    values: tuple  # temperature, top_k, top_p, min_p, repetition, presence, frequency penalty, hashed seed
    has_filter: bool  # a sampled row with top-k, top-p or min-p
    has_penalty: bool
    has_bias: bool  # logit_bias, allowed_token_ids or bad_words (min_tokens adds a bias only while it is pending)


def _sampling_row(seq: Sequence) -> SamplingRow:
    row = seq.sampling_row
    if row is None:  # the batch builds every step: the per-row Python work is done once per sequence
        p = seq.params
        draw = _draw_params(p)
        row = SamplingRow(values=(*draw, p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
                                  hash_seed(_seed_of(seq))),
                          has_filter=_has_filter(*draw[1:]), has_penalty=has_penalty(p),
                          has_bias=bool(p.logit_bias or p.banned_token_ids or p.bad_words_token_ids))
        seq.sampling_row = row
    return row


def _seed_of(seq: Sequence) -> int:
    # The engine sets sampling_seed on every sequence; the fallbacks keep the sampler usable without it.
    seed = seq.sampling_seed
    if seed is None:
        seed = seq.params.seed if seq.params.seed is not None else seq.seq_id
    return seed


def _draw_params(p: SamplingParams) -> tuple[float, int, float, float]:
    # Greedy rows get temperature 0 and no filters, so the arrays say exactly what applies to each row.
    return (p.temperature, p.top_k, p.top_p, p.min_p) if p.temperature >= GREEDY_EPS else _NO_DRAW


def _has_filter(top_k: int, top_p: float, min_p: float) -> bool:
    return top_k > 0 or top_p < 1.0 or min_p > 0.0


def has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def has_dynamic_bias(p: SamplingParams) -> bool:
    """Whether the row's bias changes with its output: a bad word of several tokens (bans its last token only after
    the ones before it)."""
    return any(len(word) > 1 for word in p.bad_words_token_ids)


def _default_history_bucket(width: int) -> int:
    return pow2_bucket(width, _HISTORY_FLOOR)


def _history(penalized: list[tuple[int, Sequence]], pad_to: int,
             bucket: Callable[[int], int]) -> tuple[np.ndarray, np.ndarray]:
    """history_ids i32[S, M] and num_prompt i32[S], filled for the (row, sequence) pairs that have a penalty."""
    # Without a repetition penalty only output tokens matter, so the (long) prompt is left out.
    rows = [(i, seq, seq.params.repetition_penalty != 1.0) for i, seq in penalized]
    width = max((seq.num_tokens if rep else seq.num_output_tokens for _, seq, rep in rows), default=0)
    num_prompt = np.zeros(pad_to, np.int32)
    if width == 0:
        return np.full((pad_to, 0), -1, np.int32), num_prompt
    padded = bucket(width)
    if padded < width:
        raise ValueError(f"history_bucket({width}) returned {padded}, narrower than the history")
    history = np.full((pad_to, padded), -1, np.int32)
    for i, seq, rep in rows:
        start = seq.num_prompt_tokens if rep else 0
        if rep:
            history[i, :start] = seq.prompt_token_ids
        history[i, start:start + seq.num_output_tokens] = seq.output_token_ids
        num_prompt[i] = start
    return history, num_prompt


def _bias_entries(seq: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """-> (token ids, the bias added to each) of the sequence's row."""
    p = seq.params
    ids, values = list((p.logit_bias or {}).keys()), list((p.logit_bias or {}).values())
    if seq.num_output_tokens < p.min_tokens:
        # As in vLLM, EOS is forbidden only when it would end the request (not with ignore_eos).
        banned = list(p.stop_token_ids or []) + ([] if p.ignore_eos else list(p.eos_token_ids))
        ids += banned
        values += [float("-inf")] * len(banned)
    if p.bad_words_token_ids:  # vLLM's rule: forbid a word's last token where the output ends in the ones before it
        output = seq.output_token_ids
        for word in p.bad_words_token_ids:
            if len(word) == 1 or (len(word) - 1 <= len(output) and tuple(output[1 - len(word):]) == word[:-1]):
                ids.append(word[-1])
                values.append(float("-inf"))
    ids_array, values_array = np.array(ids, np.int32), np.array(values, np.float32)
    if p.banned_token_ids:  # the vocabulary outside allowed_token_ids: forbidden
        ids_array = np.concatenate([ids_array, np.asarray(p.banned_token_ids, np.int32)])
        values_array = np.concatenate([values_array, np.full(len(p.banned_token_ids), -np.inf, np.float32)])
    return ids_array, values_array


def _bias(biased: list[tuple[int, Sequence]], pad_to: int) -> tuple[np.ndarray, np.ndarray]:
    """bias_ids i32[S, B] and bias_values f32[S, B] (-1 id padding) of the (row, sequence) pairs that may have one."""
    entries = [(i, _bias_entries(seq)) for i, seq in biased]
    width = pow2_bucket(max((len(e[0]) for _, e in entries), default=0), _BIAS_FLOOR)
    ids = np.full((pad_to, width), -1, np.int32)
    values = np.zeros((pad_to, width), np.float32)
    for i, (row_ids, row_values) in entries:
        ids[i, :len(row_ids)], values[i, :len(row_ids)] = row_ids, row_values
    return ids, values


# ---------------------------------------------------------------------------------------------- device side


def greedy_argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax over the vocabulary of f32[S, V] -> i32[S] (an executor may bring a faster one: same answer)."""
    return jnp.argmax(x, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=2)
def sample(logits: jax.Array, meta: SamplingMetadata,
           argmax: Callable[[jax.Array], jax.Array] = greedy_argmax) -> SamplerOutput:
    """Pick one token per row of logits f32[S, V]; the static flags in meta choose which work is compiled."""
    logits = logits.astype(jnp.float32)
    x = _apply_bias(logits, meta.bias_ids, meta.bias_values)
    if meta.needs_penalties:
        x = _apply_penalties(x, meta)
    if meta.token_bitmask.shape[1]:  # before temperature and the filters: they see the allowed tokens only
        x = _apply_bitmask(x, meta.token_bitmask)
    token_ids = argmax(x)
    if not meta.all_greedy:  # a batch of greedy rows skips the draw at run time (see for_burst)
        greedy = meta.temperature == 0
        token_ids = jax.lax.cond(jnp.all(greedy), lambda: token_ids,
                                 lambda: jnp.where(greedy, token_ids, _draw(x, meta)))
    if not meta.needs_logprobs:  # a logsumexp over the whole vocabulary is not free: skip it when nobody asks
        return no_logprobs(token_ids)
    lse = jax.nn.logsumexp(logits, axis=-1)  # normaliser of the raw logprobs
    chosen, ranks = _chosen_logprobs(logits, lse, token_ids)
    top_ids, top_logprobs = _top_logprobs(logits, lse, meta.num_logprobs)
    return SamplerOutput(token_ids=token_ids, logprobs=chosen, top_ids=top_ids, top_logprobs=top_logprobs,
                         ranks=ranks)


def no_logprobs(token_ids: jax.Array) -> SamplerOutput:
    """The sampler's output where no row asked for logprobs: the tokens, zeros (and no top entries) for the rest."""
    rows = token_ids.shape[0]
    return SamplerOutput(token_ids=token_ids, logprobs=jnp.zeros(rows, jnp.float32),
                         top_ids=jnp.zeros((rows, 0), jnp.int32), top_logprobs=jnp.zeros((rows, 0), jnp.float32),
                         ranks=jnp.zeros(rows, jnp.int32))


def _chosen_logprobs(logits: jax.Array, lse: jax.Array, token_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Raw logprobs f32[S] of token_ids i32[S] (ids in range) under logits f32[S, V] with normaliser lse f32[S], and
    their ranks i32[S]: the count of the row's logprobs >= the token's (vLLM's batched_count_greater_than, over the
    logprobs rather than the logits so that ties fall as vLLM's do)."""
    logprobs = logits - lse[:, None]
    chosen = jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)[:, 0]
    ranks = jnp.sum(logprobs >= chosen[:, None], axis=-1, dtype=jnp.int32)
    return chosen, ranks


def _drop_padding(ids: jax.Array, vocab: int) -> jax.Array:
    # -1 would wrap to the last token under .at[]; an out-of-range id is dropped by mode="drop" instead.
    return jnp.where(ids < 0, vocab, ids)


def _apply_bias(x: jax.Array, ids: jax.Array, values: jax.Array) -> jax.Array:
    if ids.shape[1] == 0:
        return x
    rows = jnp.arange(x.shape[0])[:, None]
    return x.at[rows, _drop_padding(ids, x.shape[1])].add(values, mode="drop")


def _apply_bitmask(x: jax.Array, bitmask: jax.Array) -> jax.Array:
    """-inf wherever a row's bit is clear (ids past the bitmask's width, none in practice, are allowed)."""
    rows, vocab = x.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32]
    allowed = bits.reshape(rows, -1)[:, :vocab] != 0
    if allowed.shape[1] < vocab:
        allowed = jnp.pad(allowed, ((0, 0), (0, vocab - allowed.shape[1])), constant_values=True)
    return jnp.where(allowed, x, -jnp.inf)


def _apply_penalties(x: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """vLLM's penalties: repetition over prompt+output tokens, frequency/presence over output tokens."""
    num_rows, vocab = x.shape
    rows = jnp.arange(num_rows)[:, None]
    ids = _drop_padding(meta.history_ids, vocab)
    is_output = jnp.arange(ids.shape[1])[None, :] >= meta.num_prompt[:, None]
    ones = is_output.astype(jnp.int32)
    counts = jnp.zeros((num_rows, vocab), jnp.int32).at[rows, ids].add(ones, mode="drop")
    seen = jnp.zeros((num_rows, vocab), jnp.bool_).at[rows, ids].set(True, mode="drop")
    rep = meta.repetition_penalty[:, None]
    x = jnp.where(seen, jnp.where(x > 0, x / rep, x * rep), x)
    x = x - meta.frequency_penalty[:, None] * counts
    return x - meta.presence_penalty[:, None] * (counts > 0)


def _draw(x: jax.Array, meta: SamplingMetadata) -> jax.Array:
    temperature = jnp.where(meta.temperature > 0, meta.temperature, 1.0)
    x = x / temperature[:, None]
    if meta.needs_filters:  # rows without a filter pass through it unchanged; a batch of them skips its sort
        wanted = jnp.any((meta.top_k > 0) | (meta.top_p < 1.0) | (meta.min_p > 0.0))
        x = jax.lax.cond(wanted, lambda x: _apply_filters(x, meta.top_k, meta.top_p, meta.min_p), lambda x: x, x)
    keys = jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(meta.seeds, meta.steps)
    return jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32)


def _apply_filters(x: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """Min-p and top-k, then top-p over what they keep, renormalised (vLLM v1's order: its min-p runs before its
    top-k/top-p sampler); each cut is a threshold on the logit."""
    vocab = x.shape[-1]
    srt = _sort_descending(x)
    m_cut = srt[:, 0] + jnp.log(min_p)  # p < min_p * p_max  <=>  logit < max_logit + log(min_p)
    k_off = (top_k <= 0) | (top_k >= vocab)
    kth = jnp.take_along_axis(srt, jnp.clip(top_k - 1, 0, vocab - 1)[:, None], axis=-1)[:, 0]
    k_cut = jnp.maximum(jnp.where(k_off, -jnp.inf, kth), m_cut)
    srt = jnp.where(srt < k_cut[:, None], -jnp.inf, srt)
    cum = jnp.cumsum(jax.nn.softmax(srt, axis=-1), axis=-1)
    mass_before = jnp.pad(cum[:, :-1], ((0, 0), (1, 0)))  # shifted rather than cum - p: stays monotone
    num_kept = jnp.sum(mass_before < top_p[:, None], axis=-1)  # >= 1: the top token has 0 mass before it
    last_kept = jnp.take_along_axis(srt, (num_kept - 1)[:, None], axis=-1)[:, 0]
    p_cut = jnp.where(top_p >= 1.0, -jnp.inf, last_kept)  # top_p = 1 keeps all, whatever the rounding
    cut = jnp.maximum(k_cut, p_cut)
    return jnp.where(x < cut[:, None], -jnp.inf, x)


def _sort_descending(x: jax.Array) -> jax.Array:
    """x sorted along its last axis, largest first, via int32 keys (XLA:CPU sorts those ~5x faster)."""
    keys = _order_bits(jax.lax.bitcast_convert_type(x, jnp.int32))
    # ~ reverses the int order, so an ascending sort of ~keys is a descending sort of keys.
    srt = ~jax.lax.sort(~keys, dimension=x.ndim - 1, is_stable=False)
    return jax.lax.bitcast_convert_type(_order_bits(srt), jnp.float32)


def _order_bits(bits: jax.Array) -> jax.Array:
    # Flipping the magnitude bits of negative floats makes int order match float order; it is its own inverse.
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _top_logprobs(logits: jax.Array, lse: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    k = min(k, logits.shape[-1])
    if k == 0:
        return jnp.zeros((logits.shape[0], 0), jnp.int32), jnp.zeros((logits.shape[0], 0), jnp.float32)
    values, ids = jax.lax.top_k(logits, k)  # top-k of the logits is top-k of log_softmax, without building it
    return ids.astype(jnp.int32), values - lse[:, None]


@functools.partial(jax.jit, static_argnums=(2, 3))
def sample_packed(logits: jax.Array, packed: jax.Array, layout: PackedLayout,
                  argmax: Callable[[jax.Array], jax.Array] = greedy_argmax) -> SamplerOutput:
    """sample() with the metadata packed by jserve.engine.packing.pack: one transfer instead of 13 arrays."""
    return sample(logits, unpack(packed, layout), argmax)


@jax.jit
def token_logprobs(logits: jax.Array, token_ids: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Raw logprobs f32[T] of token_ids i32[T] under logits f32[T, V], the top MAX_LOGPROBS per row (ids, logprobs)
    and the ranks i32[T] of token_ids (as SamplerOutput.ranks)."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    chosen, ranks = _chosen_logprobs(logits, lse, token_ids)
    top_ids, top_logprobs = _top_logprobs(logits, lse, MAX_LOGPROBS)
    return chosen, top_ids, top_logprobs, ranks


def for_burst(meta: SamplingMetadata) -> SamplingMetadata:
    """The metadata a decode burst takes: the draw and the filters compiled in whatever its rows ask, each skipped at
    run time where no row needs it, so one executable per batch bucket serves greedy, sampled and filtered bursts
    (bursts never carry penalties or logprobs). Each row samples exactly what the specialized sampler would."""
    return dataclasses.replace(meta, all_greedy=False, needs_filters=True)


def warmup_metadata(rows: int) -> list[SamplingMetadata]:
    """Metadata for the common sampler variants (greedy; sampled; sampled with top-k/top-p), for warm-up.

    Penalties, logit bias and logprobs compile their own variants on first use.
    """
    variants = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
                SamplingParams(temperature=1.0, top_p=0.9)]
    return [build_metadata([Sequence("warmup", [0], p)], pad_to=rows) for p in variants]
