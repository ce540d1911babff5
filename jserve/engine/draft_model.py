"""The draft-model proposer: a smaller model with the target's tokenizer drafts k tokens a step.

The draft runs on an executor of its own (the target's kind, on the target's mesh) with its own paged KV cache of the
target's blocks: the same number of the same size, addressed through the target's block tables. A sequence's draft
K/V so lies at the very slots of its target K/V, in the draft's arrays, and needs no block manager of its own; the
scheduler's block allocation for a speculative step (its last known token and k drafts) covers every position the
draft writes.

The draft computes lazily. When a sequence drafts, the draft first computes what it has not (the whole prompt the
first time, after a preemption or a spell without speculation) in prefill passes that sample nothing, then runs k
decode steps, every drafting sequence in each; the first also takes the one token the draft may not have seen since
its last round (the last draft, when all were accepted). What it wrote for
drafts the target rejected is stale: each sequence records what the draft wrote where (`Sequence.draft_computed`,
`draft_tail`), and the next round keeps only what still matches the sequence's tokens. Whatever the draft's cache
holds, the output stays exact: the rejection sampler checks every draft against the target with the distribution the
draft drew it from (`draft_probs`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jserve.config import EngineConfig, ModelConfig, ModelLoadError, SpeculativeConfig
from jserve.engine.sampler import hash_seed
from jserve.engine.sequence import ScheduledSeq, Sequence
from jserve.engine.speculative import Proposer, SpecLayout
from jserve.executors import choose_executor
from jserve.executors.base import pick_bucket
from jserve.executors.xla import XlaExecutor
from jserve.loading import model_config, resolve_model_path
from jserve.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

# Folded into a draft row's key, so the draft's draw is independent of the target's at the same step.
_DRAFT_STREAM = 0xD8AF


class DraftModelProposer(Proposer):
    def __init__(self, executor: XlaExecutor, num_speculative_tokens: int):
        """executor: the draft model's, built with the target's num_blocks, block_size and batch limits."""
        self.executor = executor
        self.k = num_speculative_tokens
        # The last round: each drafting sequence's round index, each step's row of each round index, each step's
        # draft distributions f32[S, V] (device); what draft_probs lays out for the step that verifies them.
        self._round_index: dict[int, int] = {}
        self._step_rows: list[np.ndarray] = []
        self._step_probs: list[jax.Array] = []

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        seqs = [seq for seq, _ in requests]
        limits = [k for _, k in requests]
        for seq in seqs:
            _validate(seq)
        self._catch_up(seqs)
        executor = self.executor
        # The first step also computes a token the draft has not seen before the last known one (the last draft of a
        # round whose drafts were all accepted), rather than spend a pass on it; every step keeps its token shape.
        first = [seq.num_tokens - seq.draft_computed for seq in seqs]
        t_pad = pick_bucket(executor.token_buckets, sum(first))
        s_pad = executor.seq_rows_for(t_pad)
        drafts: list[list[int]] = [[] for _ in seqs]
        # A greedy sequence's drafts are verified without their distribution: a round of greedy ones keeps none.
        greedy = all(seq.params.temperature == 0 for seq in seqs)
        self._round_index = {seq.seq_id: i for i, seq in enumerate(seqs)}
        self._step_rows, self._step_probs = [], []
        for step in range(max(limits)):
            active = [i for i, k in enumerate(limits) if k > step]
            chunks = [ScheduledSeq(_DraftView(seqs[i], [], seqs[i].draft_computed), first[i], sample=True)
                      for i in active] if step == 0 else \
                [ScheduledSeq(_DraftView(seqs[i], drafts[i]), 1, sample=True) for i in active]
            batch = executor.prepare(chunks, num_tokens_bucket=t_pad)
            logits = executor.run(batch)
            if greedy:
                tokens = draft_argmax(logits, executor.argmax)
            else:
                tokens, probs = draft_sample(logits, *_sampling_rows([seqs[i] for i in active], step, s_pad))
                rows = np.full(len(seqs), -1, np.int32)
                rows[active] = np.arange(len(active), dtype=np.int32)
                self._step_rows.append(rows)
                self._step_probs.append(probs)
            for row, token in zip(active, np.asarray(tokens)[:len(active)].tolist(), strict=True):
                drafts[row].append(token)
        for seq, draft in zip(seqs, drafts, strict=True):
            # Written this round from position num_tokens - 1: the last known token, then every draft but the last.
            seq.draft_computed = seq.num_tokens - 1
            seq.draft_tail = [seq.token_at(seq.num_tokens - 1), *draft[:-1]]
        return drafts

    def draft_probs(self, chunks: list[ScheduledSeq], layout: SpecLayout) -> jax.Array | None:
        if not self._step_probs:  # a greedy round
            return None
        num_rows = len(layout.row_seq)
        step = np.full(num_rows, -1, np.int32)
        source = np.zeros(num_rows, np.int32)
        for i, chunk in enumerate(chunks):
            index = self._round_index.get(chunk.seq.seq_id)
            for j in range(len(chunk.draft_token_ids)):
                row = layout.row_start[i] + j
                step[row], source[row] = j, self._step_rows[j][index]
        probs = self._step_probs + [self._step_probs[-1]] * (self.k - len(self._step_probs))
        return gather_draft_probs(tuple(probs), step, source)

    def warmup(self, logits_rows: list[int]) -> int:
        """Compile the draft's step shapes, its sampler at every decode round's rows, and the gather of its
        distributions into every verifying step's logits_rows."""
        executor = self.executor
        batches = list(executor.warmup_batches())
        if executor.mesh is None:
            executor.compile_ahead(batches)
        else:
            for batch in batches:
                executor.run(batch)
        vocab = executor.config.vocab_size
        decode_rows = sorted({executor.seq_rows_for(t_pad) for t_pad in executor.token_buckets})
        sharding = executor.devices_of_logits()
        for s_pad in decode_rows:
            logits = jax.device_put(jnp.zeros((s_pad, vocab), jnp.float32), sharding)
            jax.block_until_ready(draft_argmax(logits, executor.argmax))
            _, probs = draft_sample(logits, *_sampling_rows([], 0, s_pad))
            for num_rows in logits_rows:
                jax.block_until_ready(gather_draft_probs((probs,) * self.k, np.full(num_rows, -1, np.int32),
                                                         np.zeros(num_rows, np.int32)))
        return len(batches)

    def reset(self) -> None:
        self.executor.reset_kv_cache()
        self._round_index, self._step_rows, self._step_probs = {}, [], []

    def _catch_up(self, seqs: list[Sequence]) -> None:
        """Compute the draft K/V of every token but each sequence's last two (the round's first step takes those),
        in passes of at most the executor's largest step (a long prompt's first round spans several); nothing is
        sampled."""
        executor = self.executor
        budget = executor.token_buckets[-1]
        pending = [seq for seq in seqs if seq.draft_computed < seq.num_tokens - 2]
        while pending:
            chunks, left = [], budget
            for seq in pending:
                if left == 0 or len(chunks) == executor.max_seq_rows:
                    break
                n = min(seq.num_tokens - 2 - seq.draft_computed, left)
                chunks.append(ScheduledSeq(_DraftView(seq, [], seq.draft_computed), n, sample=False))
                left -= n
            executor.run(executor.prepare(chunks))
            for chunk in chunks:
                chunk.seq.seq.draft_computed += chunk.num_new_tokens
            pending = [seq for seq in pending if seq.draft_computed < seq.num_tokens - 2]


class _DraftView:
    """A sequence as a draft step computes it: its tokens then this round's drafts, computed from `start`, in the
    sequence's blocks (what XlaExecutor.prepare reads of a sequence)."""

    __slots__ = ("seq", "drafts", "num_computed_tokens", "block_table")

    def __init__(self, seq: Sequence, drafts: list[int], start: int | None = None):
        self.seq, self.drafts = seq, drafts
        self.num_computed_tokens = seq.num_tokens - 1 + len(drafts) if start is None else start
        self.block_table = seq.block_table

    def token_at(self, position: int) -> int:
        num_tokens = self.seq.num_tokens
        return self.seq.token_at(position) if position < num_tokens else self.drafts[position - num_tokens]

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.drafts


def _validate(seq: Sequence) -> None:
    """Keep of what the draft wrote last round only what matches the sequence's tokens now (the accepted drafts)."""
    tail, start = seq.draft_tail, seq.draft_computed
    if tail:
        matched = 0
        for written, token in zip(tail, seq.token_ids[start: start + len(tail)], strict=False):
            if written != token:
                break
            matched += 1
        seq.draft_computed, seq.draft_tail = start + matched, []
    seq.draft_computed = min(seq.draft_computed, seq.num_tokens - 1)


def _sampling_rows(seqs: list[Sequence], step: int, num_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(temperature f32, seed u32, step i32)[num_rows]: each drafting sequence's draw `step` tokens ahead (padding
    rows greedy)."""
    temperature = np.zeros(num_rows, np.float32)
    seeds = np.zeros(num_rows, np.uint32)
    steps = np.zeros(num_rows, np.int32)
    for row, seq in enumerate(seqs):
        temperature[row] = seq.params.temperature
        seeds[row] = hash_seed(seq.sampling_seed or 0)
        steps[row] = seq.num_output_tokens + step
    return temperature, seeds, steps


@functools.partial(jax.jit, static_argnums=1)
def draft_argmax(logits: jax.Array, argmax: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """A greedy round's draft tokens i32[S] (the executor's argmax: on CPU the C++ one)."""
    return argmax(logits)


@jax.jit
def draft_sample(logits: jax.Array, temperature: jax.Array, seeds: jax.Array,
                 steps: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The draft's tokens i32[S] and the distributions f32[S, V] they are drawn from: softmax(logits / temperature)
    for a sampled row (the target's temperature; its filters apply to the target only, which keeps the output exact
    whatever the draft draws from); the argmax for a greedy row (in a round with sampled ones), whose verification
    needs no distribution."""
    logits = logits.astype(jnp.float32)
    greedy = temperature == 0
    log_probs = jax.nn.log_softmax(logits / jnp.where(greedy, 1.0, temperature)[:, None], axis=-1)
    keys = jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step),
                                                          _DRAFT_STREAM))(seeds, steps)
    sampled = jax.vmap(jax.random.categorical)(keys, log_probs)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
    return tokens, jnp.exp(log_probs)


@jax.jit
def gather_draft_probs(probs: tuple[jax.Array, ...], step: np.ndarray, source: np.ndarray) -> jax.Array:
    """f32[L, V]: row r the distribution of draft step step[r] at its row source[r] (zeros where step is -1)."""
    stacked = jnp.stack(probs)  # [k, S, V]
    rows = stacked[jnp.maximum(step, 0), source]
    return jnp.where((step >= 0)[:, None], rows, 0.0)


@dataclasses.dataclass(frozen=True)
class DraftModel:
    """A draft model checked against its target: where it is and its config."""

    path: Path
    config: ModelConfig


def open_draft_model(spec: SpeculativeConfig, target: ModelConfig, tokenizer: Tokenizer,
                     max_model_len: int) -> DraftModel:
    """The draft model `spec.model` names, refused (ValueError naming the field) where its tokens could not be the
    target's: another vocabulary or tokenizer, or a context shorter than the engine's max_model_len."""
    try:
        path = resolve_model_path(spec.model)
        config = model_config(path)
        draft_tokenizer = load_tokenizer(str(path))
    except ModelLoadError as e:
        raise ValueError(f"speculative_config.model {spec.model!r} cannot be loaded: {e}") from e
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model {spec.model!r} has a vocabulary of {config.vocab_size} tokens, "
                         f"the target model {target.vocab_size}: a draft model must share the target's tokenizer")
    if draft_tokenizer.hf.get_vocab() != tokenizer.hf.get_vocab():
        raise ValueError(f"speculative_config.model {spec.model!r} has another tokenizer than the target model (their "
                         "vocabularies map tokens to different ids): a draft model must share the target's tokenizer")
    if config.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config.model {spec.model!r} takes {config.max_position_embeddings} positions, "
                         f"fewer than max_model_len {max_model_len}: lower max_model_len or choose another draft")
    return DraftModel(path, config)


def build_draft_proposer(draft: DraftModel, config: EngineConfig, mesh: Mesh | None, num_blocks: int,
                         max_model_len: int) -> DraftModelProposer:
    """The draft model loaded on an executor of the kind the engine's settings choose for it (on the target's mesh)
    with a KV cache of the target's blocks, as a proposer."""
    executor_class, attention, why = choose_executor(config.executor, config.attention_backend,
                                                     sharded=mesh is not None, kv_cache_dtype=config.kv_cache_dtype)
    logger.info("draft model %s: executor %s (%s), attention %s", draft.path, executor_class.name, why, attention)
    model = executor_class.load(draft.path, dtype=config.dtype, attention_backend=attention, mesh=mesh,
                                load_format=config.load_format, max_model_len=max_model_len)
    executor = executor_class(model, dtype=config.dtype, num_blocks=num_blocks, block_size=config.block_size,
                              max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
                              max_model_len=max_model_len, mesh=mesh, kv_cache_dtype=config.kv_cache_dtype)
    return DraftModelProposer(executor, config.speculative_config.num_speculative_tokens)
