"""The pytrees a jitted step takes and returns: the ragged token batch and the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import jax


@jax.tree_util.register_dataclass
@dataclass
class StepBatch:
    """One step's tokens, flattened over sequences and padded to a (T, S, P) bucket.

    Padding tokens carry slot `num_slots` (their K/V write is dropped) and sequence row 0; padding sequence
    rows point their logits at token 0 and are ignored by the caller.
    """

    token_ids: jax.Array  # i32[T]
    positions: jax.Array  # i32[T] position of each token in its sequence
    slot_mapping: jax.Array  # i32[T] flat cache slot (page * page_size + offset) the token's K/V goes to
    token_seq: jax.Array  # i32[T] sequence row of each token
    page_table: jax.Array  # i32[S, P] page ids of each sequence's logical blocks
    seq_lens: jax.Array  # i32[S] tokens in each sequence's KV after this step
    query_start: jax.Array  # i32[S + 1] offset of each sequence's first token in token_ids
    logits_indices: jax.Array  # i32[S] token whose output predicts each sequence's next token
    lora_slots: jax.Array | None = None  # i32[S] adapter slot of each sequence row, -1 none (LoRA engines only)


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    """The paged key and value caches of every layer, donated to every step and returned updated in place.

    Per layer (a list of arrays) or stacked (one array each, layer first): a jitted call pays its dispatch per array
    argument, so the CPU kernels, which take the whole stack in one call, get 2 arrays instead of 2 x num_layers."""

    k: list[jax.Array] | jax.Array  # num_layers x [num_pages, page_size, num_kv_heads, head_dim], or stacked
    v: list[jax.Array] | jax.Array  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]; a layer whose
    # attention reads its values from the key pages (ModelConfig.values_in_key_pages) has None

    @property
    def stacked(self) -> bool:
        return not isinstance(self.k, list | tuple)
