"""Host-side bookkeeping for the paged KV cache: which blocks each sequence owns, and the prefix cache.

The device arrays live elsewhere; this module only hands out block ids. A full block whose tokens have been
computed is registered under a chained key (a keyed BLAKE2b digest of its parent block's key, its own tokens and
the request's cache salt), so a later sequence with the same prefix and salt can share it instead of recomputing
it. Freed blocks keep their key and stay reusable until a fresh block is needed, which evicts the least recently
freed one first.

Keys are cryptographic so that one request cannot craft a prompt whose blocks collide with another's and read
its KV; the per-process random key makes the digests unpredictable from outside as well. A lookup still compares
the stored parent key, tokens and salt, so even a colliding digest never shares a block with different content.
Cost: about 1 us per 16-token block on the host (tests/test_tenancy.py measures it).
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict
from collections.abc import Iterable

from jserve.engine.sequence import Sequence


class Block:
    """One KV block: how many sequences use it and, once full and computed, its prefix key and what it holds."""

    __slots__ = ("block_id", "ref_count", "hash", "parent_hash", "token_ids", "salt")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.parent_hash: bytes | None = None
        self.token_ids: tuple[int, ...] = ()
        self.salt: bytes = b""

    def clear_hash(self) -> None:
        self.hash = None
        self.parent_hash = None
        self.token_ids = ()
        self.salt = b""


# Per-process secret: block keys cannot be predicted (or precomputed to collide) from outside the process.
# The keyed state is built once and copied per block (copying is cheaper than re-keying).
_KEYED = hashlib.blake2b(digest_size=32, key=os.urandom(32))
_NO_PARENT = b"\0" * 32


def block_hash(parent_hash: bytes | None, token_ids: tuple[int, ...], salt: bytes = b"") -> bytes:
    """The block's 32-byte prefix key: keyed BLAKE2b over the parent's key, the token ids and the salt.

    The parent key and the token count have fixed widths and the tokens 8 bytes each, so the salt (last) is
    unambiguous: no two different inputs share an encoding.
    """
    h = _KEYED.copy()
    h.update((parent_hash or _NO_PARENT) + len(token_ids).to_bytes(4, "little") + array("q", token_ids).tobytes()
             + salt)
    return h.digest()


def salt_of(seq: Sequence) -> bytes:
    """The sequence's prefix-cache salt as bytes (b"" when unsalted)."""
    salt = seq.params.cache_salt
    salt = b"" if salt is None else salt.encode("utf-8", "surrogatepass")
    if seq.lora is not None:  # an adapter's K/V differ from the base model's and from any other adapter's; 0xff
        # starts no UTF-8 salt, so no salt of a request without an adapter reads as this one
        salt = b"\xff" + seq.lora.serial.to_bytes(8, "little") + salt
    return salt


class BlockManager:
    """Reference-counted KV blocks with a free queue and a prefix cache.

    `free_queue` holds every block with ref count 0, oldest first: the head is what the next fresh allocation
    takes (evicting its cached prefix, if any).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[bytes, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # tokens found there

    # ----- capacity -----

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ----- prefix cache -----

    def allocate_prefix(self, seq: Sequence) -> None:
        """Give a waiting sequence the longest run of cached blocks matching its tokens."""
        assert not seq.block_table and seq.num_computed_tokens == 0, f"{seq} already holds blocks"
        # prompt_logprobs needs logits at every prompt position, so such a request computes its whole prompt.
        wants_all = seq.params.prompt_logprobs is not None
        matched = self._match_prefix(seq) if self.enable_prefix_caching and not wants_all else []
        for block_id in matched:
            self._take(block_id)
        seq.block_table = matched
        seq.num_computed_tokens = len(matched) * self.block_size
        self.prefix_cache_queries += seq.num_tokens
        self.prefix_cache_hits += seq.num_computed_tokens
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed_tokens

    def cancel_prefix(self, seq: Sequence) -> None:
        """Undo `allocate_prefix` (the sequence could not be admitted after all), hit counters included."""
        self.prefix_cache_queries -= seq.num_tokens
        self.prefix_cache_hits -= seq.num_computed_tokens
        if seq.block_table:
            self.free(seq)

    def _match_prefix(self, seq: Sequence) -> list[int]:
        # Never match the block holding the last token: the model must compute at least one token for logits.
        max_blocks = (seq.num_tokens - 1) // self.block_size
        token_ids = seq.token_ids
        salt = salt_of(seq)
        matched: list[int] = []
        parent: bytes | None = None
        for i in range(max_blocks):
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = block_hash(parent, tokens, salt)
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            # Same key but other content is a collision, not a match: the full comparison keeps requests apart.
            if block.hash != h or block.token_ids != tokens or block.parent_hash != parent or block.salt != salt:
                break
            matched.append(block_id)
            parent = h
        return matched

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (e.g. after a weight update); refused (False) while blocks are used."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.clear_hash()
        self.hash_to_block.clear()
        return True

    # ----- allocation -----

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(0, self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give the sequence blocks for positions [0, num_computed_tokens + num_new_tokens); False if full."""
        needed = self.num_new_blocks(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            return False
        seq.block_table.extend(self._allocate_fresh() for _ in range(needed))
        self._assert_writable(seq, num_new_tokens)
        return True

    def _assert_writable(self, seq: Sequence, num_new_tokens: int) -> None:
        # Only full computed blocks are shared, and new tokens go past them: a shared block is never written.
        first = seq.num_computed_tokens // self.block_size
        last = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        for block_id in seq.block_table[first:last]:
            block = self.blocks[block_id]
            assert block.ref_count == 1 and block.hash is None, f"block {block_id} is shared or cached"

    def mark_computed(self, seq: Sequence, num_new_tokens: int) -> None:
        """Record that the model wrote K/V for the next tokens, and cache the blocks that became full."""
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        assert end <= min(seq.num_tokens, len(seq.block_table) * self.block_size), f"{seq}: no slot for {end}"
        seq.num_computed_tokens = end
        if not self.enable_prefix_caching:
            return
        first_full, last_full = start // self.block_size, end // self.block_size
        if first_full < last_full:
            token_ids = seq.token_ids
            for i in range(first_full, last_full):
                self._register(seq, i, token_ids)

    def _register(self, seq: Sequence, index: int, token_ids: list[int]) -> None:
        block = self.blocks[seq.block_table[index]]
        parent = self.blocks[seq.block_table[index - 1]].hash if index > 0 else None
        if index > 0 and parent is None:
            return  # the chain is broken (the cache was reset under us), so this block cannot be found anyway
        tokens = tuple(token_ids[index * self.block_size:(index + 1) * self.block_size])
        salt = salt_of(seq)
        block.hash = block_hash(parent, tokens, salt)
        block.parent_hash, block.token_ids, block.salt = parent, tokens, salt
        # Two sequences may compute the same block at once; the first registered copy stays the findable one.
        self.hash_to_block.setdefault(block.hash, block.block_id)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; cached blocks stay findable until evicted."""
        if not seq.block_table:
            raise ValueError(f"{seq} holds no blocks (freed twice?)")
        # Reverse order: a sequence's tail blocks are the least likely to be shared, so they go first.
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.draft_computed, seq.draft_tail = 0, []  # a draft model's K/V lay in the same blocks

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past the ones num_tokens positions need (a speculative step's rejected drafts held
        the slots of the tail blocks; nothing was hashed there, as only computed tokens are)."""
        keep = self.num_blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    # ----- single blocks -----

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _allocate_fresh(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        self._evict(block)
        block.ref_count = 1
        return block_id

    def _evict(self, block: Block) -> None:
        if block.hash is not None and self.hash_to_block.get(block.hash) == block.block_id:
            del self.hash_to_block[block.hash]
        block.clear_hash()

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} released with ref count {block.ref_count}"
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        self.free_queue[block_id] = None
        if block.hash is None or self.hash_to_block.get(block.hash) != block_id:
            # Nothing can find this block again, so reuse it before any block that holds a cached prefix.
            block.clear_hash()
            self.free_queue.move_to_end(block_id, last=False)

    # ----- checks -----

    def check_invariants(self, seqs: Iterable[Sequence] | None = None) -> None:
        """Assert the bookkeeping is consistent; given every live sequence, also that no block leaked."""
        free = list(self.free_queue)
        assert len(free) == len(set(free)), "duplicate block in the free queue"
        for block in self.blocks:
            assert block.ref_count >= 0, f"block {block.block_id} has ref count {block.ref_count}"
            assert (block.ref_count == 0) == (block.block_id in self.free_queue), \
                f"block {block.block_id}: ref count {block.ref_count} disagrees with the free queue"
        for h, block_id in self.hash_to_block.items():
            assert self.blocks[block_id].hash == h, f"hash map points at block {block_id} with another hash"
        assert self.num_free_blocks + sum(b.ref_count > 0 for b in self.blocks) == self.num_blocks
        assert 0 <= self.prefix_cache_hits <= self.prefix_cache_queries
        if seqs is None:
            return
        refs = [0] * self.num_blocks
        for seq in seqs:
            assert len(seq.block_table) == len(set(seq.block_table)), f"{seq} lists a block twice"
            for block_id in seq.block_table:
                refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], \
                f"block {block.block_id}: ref count {block.ref_count}, held by {refs[block.block_id]} seqs"
