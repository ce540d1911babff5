"""BlockManager: ref counts, the free queue, prefix sharing and LRU eviction of cached blocks."""

import pytest

from jserve.engine.kv_cache import BlockManager
from jserve.engine.sequence import Sequence
from jserve.sampling_params import SamplingParams


def make_seq(tokens, request_id="r"):
    return Sequence(request_id, list(tokens), SamplingParams(max_tokens=4))


def run_prefill(bm, seq):
    """Admit a sequence the way the scheduler does and compute all of its tokens."""
    bm.allocate_prefix(seq)
    num_new = seq.num_tokens - seq.num_computed_tokens
    assert bm.allocate_slots(seq, num_new)
    bm.mark_computed(seq, num_new)


def test_allocate_and_free_track_ref_counts():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(range(10))
    bm.allocate_prefix(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert bm.can_allocate(seq, 10)
    assert bm.allocate_slots(seq, 10)
    assert len(seq.block_table) == 3
    assert bm.num_free_blocks == 5 and bm.usage == pytest.approx(3 / 8)
    assert all(bm.blocks[b].ref_count == 1 for b in seq.block_table)
    bm.mark_computed(seq, 10)
    assert seq.num_computed_tokens == 10
    bm.check_invariants([seq])

    bm.free(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == 8 and bm.usage == 0.0
    bm.check_invariants([seq])


def test_allocation_grows_one_block_at_a_time_and_fails_atomically():
    bm = BlockManager(num_blocks=3, block_size=4)
    seq = make_seq(range(4))
    run_prefill(bm, seq)
    assert len(seq.block_table) == 1
    seq.append_token(99)
    assert bm.allocate_slots(seq, 1)  # position 4 starts a second block
    assert len(seq.block_table) == 2

    other = make_seq(range(100, 109))  # needs 3 blocks, only 1 left
    bm.allocate_prefix(other)
    assert not bm.can_allocate(other, 9)
    assert not bm.allocate_slots(other, 9)
    assert other.block_table == [] and bm.num_free_blocks == 1
    bm.check_invariants([seq, other])


def test_common_prefix_shares_blocks_and_counts_hits():
    bm = BlockManager(num_blocks=16, block_size=4)
    prefix = list(range(12))  # three full blocks
    a = make_seq(prefix + [50], "a")
    run_prefill(bm, a)
    assert bm.prefix_cache_hits == 0 and bm.prefix_cache_queries == 13

    b = make_seq(prefix + [60, 61, 62, 63, 64], "b")
    bm.allocate_prefix(b)
    assert b.block_table == a.block_table[:3]
    assert b.num_computed_tokens == 12 and b.num_cached_tokens == 12
    assert all(bm.blocks[block].ref_count == 2 for block in b.block_table)
    assert bm.prefix_cache_hits == 12 and bm.prefix_cache_queries == 13 + 17

    assert bm.allocate_slots(b, 5)
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3:] != a.block_table[3:]
    bm.mark_computed(b, 5)
    bm.check_invariants([a, b])

    bm.free(a)
    assert all(bm.blocks[block].ref_count == 1 for block in b.block_table)
    bm.free(b)
    assert bm.num_free_blocks == 16
    bm.check_invariants()


def test_chain_hash_depends_on_the_whole_prefix():
    bm = BlockManager(num_blocks=8, block_size=2)
    run_prefill(bm, make_seq([1, 2, 3, 4, 5]))
    other = make_seq([9, 9, 3, 4, 5])  # same second block, different first block
    bm.allocate_prefix(other)
    assert other.block_table == [] and other.num_computed_tokens == 0


def test_block_holding_the_last_token_is_never_matched():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(12))
    first = make_seq(tokens)
    run_prefill(bm, first)
    bm.free(first)

    again = make_seq(tokens)  # all three blocks are cached, but the model must compute the last token
    bm.allocate_prefix(again)
    assert again.num_computed_tokens == 8 and len(again.block_table) == 2
    assert bm.allocate_slots(again, 4)
    assert len(again.block_table) == 3
    bm.check_invariants([again])


def test_freed_cached_blocks_count_as_free_and_are_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = make_seq([1, 2, 9], "a"), make_seq([3, 4, 9], "b")
    for seq in (a, b):
        run_prefill(bm, seq)
        bm.free(seq)  # each leaves one cached full block and one uncached tail block
    assert bm.num_free_blocks == 4

    held = make_seq([5, 6, 7], "c")
    run_prefill(bm, held)  # takes the two uncached blocks first: nothing is evicted
    assert bm.num_free_blocks == 2
    assert make_and_match(bm, [1, 2, 0]) == 2 and make_and_match(bm, [3, 4, 0]) == 2

    newer = make_seq([8], "d")
    assert bm.allocate_slots(newer, 1)  # a fresh block evicts the least recently freed cached one: a's
    assert make_and_match(bm, [1, 2, 0]) == 0
    assert make_and_match(bm, [3, 4, 0]) == 2
    bm.check_invariants([held, newer])


def make_and_match(bm, tokens):
    """Tokens the prefix cache would give this prompt now (the lookup is undone)."""
    seq = make_seq(tokens)
    bm.allocate_prefix(seq)
    matched = seq.num_computed_tokens
    bm.cancel_prefix(seq)
    return matched


def test_cancel_prefix_restores_blocks_and_counters():
    bm = BlockManager(num_blocks=4, block_size=2)
    first = make_seq([1, 2, 3])
    run_prefill(bm, first)
    bm.free(first)
    queries, hits, free = bm.prefix_cache_queries, bm.prefix_cache_hits, bm.num_free_blocks

    seq = make_seq([1, 2, 3, 4, 5])
    bm.allocate_prefix(seq)
    assert seq.num_computed_tokens == 2 and bm.num_free_blocks == free - 1
    bm.cancel_prefix(seq)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits, bm.num_free_blocks) == (queries, hits, free)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    bm.check_invariants([seq])


def test_preempted_sequence_resumes_from_its_outputs():
    bm = BlockManager(num_blocks=8, block_size=2)
    seq = make_seq([1, 2, 3])
    run_prefill(bm, seq)
    for token in (4, 5, 6):  # decode three tokens
        seq.append_token(token)
        assert bm.allocate_slots(seq, 1)
        bm.mark_computed(seq, 1)
    seq.append_token(7)
    assert seq.num_computed_tokens == 6 and seq.num_tokens == 7
    bm.free(seq)
    seq.num_preemptions += 1

    bm.allocate_prefix(seq)
    assert seq.num_computed_tokens == 6  # blocks [1,2] [3,4] [5,6]: output tokens come back too
    assert seq.num_cached_tokens == 0  # only the first admission reports cached prompt tokens


def test_double_free_raises():
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = make_seq([1, 2, 3])
    run_prefill(bm, seq)
    bm.free(seq)
    with pytest.raises(ValueError, match="freed twice"):
        bm.free(seq)
    bm.check_invariants([seq])
    assert bm.num_free_blocks == 4


def test_shared_block_is_never_written():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])
    run_prefill(bm, a)
    b = make_seq([1, 2, 3, 4, 6])
    bm.allocate_prefix(b)
    assert b.num_computed_tokens == 4
    b.num_computed_tokens = 2  # a bug that would overwrite the shared second block
    with pytest.raises(AssertionError, match="shared or cached"):
        bm.allocate_slots(b, 3)


def test_reset_prefix_cache_only_when_idle():
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = make_seq([1, 2, 3])
    run_prefill(bm, seq)
    assert not bm.reset_prefix_cache()
    bm.free(seq)
    assert bm.reset_prefix_cache()
    assert make_and_match(bm, [1, 2, 3]) == 0
    bm.check_invariants()


def test_prefix_caching_disabled_never_matches():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    run_prefill(bm, make_seq([1, 2, 3, 4, 5]))
    assert make_and_match(bm, [1, 2, 3, 4, 5]) == 0
    assert not bm.hash_to_block


def test_data_parallel_snapshot_adds_up_the_replicas():
    from jserve.engine.data_parallel import DataParallelEngine
    from jserve.engine.engine import EngineSnapshot

    class Replica:  # what the front reads of an engine: its snapshot
        def __init__(self, bm: BlockManager):
            self.bm = bm

        def snapshot(self) -> EngineSnapshot:
            return EngineSnapshot(num_blocks=self.bm.num_blocks, num_free_blocks=self.bm.num_free_blocks,
                                  prefix_cache_queries=self.bm.prefix_cache_queries)

    first, second = BlockManager(num_blocks=8, block_size=4), BlockManager(num_blocks=4, block_size=4)
    run_prefill(first, make_seq(range(10)))  # 3 blocks
    run_prefill(second, make_seq(range(100, 104), "s"))  # 1 block
    front = DataParallelEngine.__new__(DataParallelEngine)
    front.replicas = [Replica(first), Replica(second)]
    pooled = front.snapshot()
    assert (pooled.num_blocks, pooled.num_free_blocks) == (12, 8)
    assert pooled.kv_cache_usage == pytest.approx(4 / 12)
    assert pooled.prefix_cache_queries == 14
