"""BlockManager without a model: allocation, rollback, reference counts, prefix caching, LRU.

"Computing" a sequence here means what the scheduler does after a forward: reserve KV slots,
advance num_computed, and register the blocks that became full.
"""
from __future__ import annotations

import pytest

from leapfrog.engine.block_manager import BlockManager, chain_hash
from leapfrog.sampling_params import SamplingParams
from leapfrog.sequence import Sequence

BS = 4


def make_seq(tokens, rid="r") -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams())


def compute(bm: BlockManager, seq: Sequence, upto: int | None = None) -> None:
    """Reserve, 'run' and register the first `upto` tokens (default: all of them)."""
    upto = len(seq.token_ids) if upto is None else upto
    assert bm.reserve(seq, upto)
    seq.num_computed = upto
    bm.register_full_blocks(seq)


def check_invariants(bm: BlockManager, seqs: list[Sequence]) -> None:
    """Reference counts equal the number of block tables holding each block; the free list
    holds exactly the unreferenced blocks; every cached hash points at a block carrying it."""
    refs = [0] * bm.num_blocks
    for s in seqs:
        for b in s.block_table:
            refs[b] += 1
    assert [b.ref_count for b in bm.blocks] == refs
    assert set(bm.free) == {i for i, r in enumerate(refs) if r == 0}
    for h, bid in bm.cached.items():
        assert bm.blocks[bid].hash == h


# --- allocation ---------------------------------------------------------------------------

def test_reserve_allocates_ceil_blocks_and_grows_incrementally():
    bm = BlockManager(8, BS)
    seq = make_seq(range(10))
    assert bm.blocks_needed(seq, 10) == 3
    assert bm.reserve(seq, 10)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert bm.num_used_blocks == 3 and bm.num_free_blocks == 5
    assert bm.reserve(seq, 12)                      # still fits in 3 blocks
    assert len(seq.block_table) == 3
    assert bm.reserve(seq, 5)                       # never shrinks
    assert len(seq.block_table) == 3
    assert bm.reserve(seq, 13)
    assert len(seq.block_table) == 4
    assert bm.blocks_needed(seq, 13) == 0
    check_invariants(bm, [seq])


def test_reserve_is_all_or_nothing():
    bm = BlockManager(4, BS)
    a, b = make_seq(range(10), "a"), make_seq(range(8), "b")
    assert bm.reserve(a, 10)                        # 3 of 4 blocks
    before = list(bm.free)
    assert not bm.reserve(b, 8)                     # needs 2, one left
    assert b.block_table == [] and list(bm.free) == before
    assert not bm.reserve(a, 17)                    # growth by 2 when 1 is free: nothing taken
    assert len(a.block_table) == 3 and list(bm.free) == before
    assert bm.reserve(a, 16)                        # exactly the last block
    assert bm.num_free_blocks == 0
    check_invariants(bm, [a, b])


def test_invalid_sizes_rejected():
    with pytest.raises(ValueError):
        BlockManager(0, BS)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


# --- truncate (rollback) ----------------------------------------------------------------------

@pytest.mark.parametrize("keep,blocks", [(13, 4), (12, 3), (9, 3), (8, 2), (5, 2), (1, 1), (0, 0)])
def test_truncate_frees_whole_blocks_past_kept_length(keep, blocks):
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    seq = make_seq(range(16))
    assert bm.reserve(seq, 16)
    table = list(seq.block_table)
    bm.truncate(seq, keep)
    assert seq.block_table == table[:blocks]
    assert bm.num_used_blocks == blocks
    assert set(table[blocks:]) <= set(bm.free)
    check_invariants(bm, [seq])


def test_truncate_then_regrow_reuses_released_blocks_first():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    seq = make_seq(range(16))
    assert bm.reserve(seq, 16)
    table = list(seq.block_table)
    bm.truncate(seq, 5)
    assert bm.reserve(seq, 16)
    assert sorted(seq.block_table[2:]) == sorted(table[2:])   # uncached blocks go to the head
    check_invariants(bm, [seq])


def test_truncate_keeps_hashes_consistent():
    bm = BlockManager(8, BS)
    orig = list(range(100, 116))                    # 4 full blocks
    seq = make_seq(orig, "a")
    compute(bm, seq)
    assert seq.num_hashed_blocks == 4
    table = list(seq.block_table)

    bm.truncate(seq, 6)                             # keep block 0 and half of block 1
    assert seq.block_table == table[:2]
    assert seq.num_hashed_blocks == 1
    check_invariants(bm, [seq])

    # Block 1 is about to be overwritten: the old prefix must not be served from it.
    probe = make_seq(orig + [1], "probe")
    assert bm.match_prefix(probe) == BS
    assert probe.block_table == table[:1]
    bm.free_seq(probe)

    # Rewrite positions 6.. with different tokens and register: the new chain is cached.
    new = orig[:6] + list(range(200, 210))
    seq.token_ids = list(new)
    compute(bm, seq)
    assert seq.num_hashed_blocks == 4
    h = None
    for i in range(4):
        toks = tuple(new[i * BS:(i + 1) * BS])
        h = chain_hash(h, toks)
        blk = bm.blocks[seq.block_table[i]]
        assert blk.hash == h and blk.token_ids == toks
    probe = make_seq(new + [1], "probe2")
    assert bm.match_prefix(probe) == 16
    assert probe.block_table == seq.block_table
    bm.free_seq(probe)
    # and the old one only matches the untouched first block
    probe = make_seq(orig + [1], "probe3")
    assert bm.match_prefix(probe) == BS
    bm.free_seq(probe)
    check_invariants(bm, [seq])


def test_truncate_to_block_boundary_keeps_cached_blocks_reusable():
    bm = BlockManager(8, BS)
    toks = list(range(12))
    seq = make_seq(toks, "a")
    compute(bm, seq)
    table = list(seq.block_table)
    bm.truncate(seq, 8)                             # block 2 released, its KV still valid
    assert seq.num_hashed_blocks == 2
    bm.free_seq(seq)
    probe = make_seq(toks + [99], "b")
    assert bm.match_prefix(probe) == 12
    assert probe.block_table == table


# --- free with reference counts -------------------------------------------------------------------

def test_free_keeps_blocks_shared_with_another_sequence():
    bm = BlockManager(8, BS)
    a = make_seq(range(12), "a")
    compute(bm, a)
    b = make_seq(list(range(8)) + [50, 51, 52], "b")
    assert bm.match_prefix(b) == 8
    assert b.block_table == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    b.num_computed = 8
    compute(bm, b)
    check_invariants(bm, [a, b])

    a_only = a.block_table[2]
    bm.free_seq(a)
    assert a.block_table == [] and a.num_hashed_blocks == 0
    assert [bm.blocks[i].ref_count for i in b.block_table[:2]] == [1, 1]
    assert not set(b.block_table) & set(bm.free)
    assert a_only in bm.free
    check_invariants(bm, [a, b])

    bm.free_seq(b)
    assert bm.num_used_blocks == 0
    check_invariants(bm, [a, b])


def test_double_release_is_detected():
    bm = BlockManager(4, BS)
    seq = make_seq(range(4))
    assert bm.reserve(seq, 4)
    bid = seq.block_table[0]
    bm.free_seq(seq)
    with pytest.raises(AssertionError):
        bm._release(bid)


# --- prefix cache ------------------------------------------------------------------------------

@pytest.fixture
def cached16():
    """A manager holding one computed 16-token sequence (4 hashed blocks)."""
    bm = BlockManager(16, BS)
    toks = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 0, 3, 1, 1, 2, 9]
    seq = make_seq(toks, "base")
    compute(bm, seq)
    return bm, seq, toks


@pytest.mark.parametrize("k", [1, 2, 3])
def test_prefix_hit_reuses_exactly_the_first_k_blocks(cached16, k):
    bm, base, toks = cached16
    probe = make_seq(toks[:k * BS] + [60, 61, 62], "p")
    assert bm.match_prefix(probe) == k * BS
    assert probe.block_table == base.block_table[:k]
    assert probe.num_hashed_blocks == k
    assert all(bm.blocks[b].ref_count == 2 for b in probe.block_table)


def test_prefix_match_stops_at_first_differing_block(cached16):
    bm, base, toks = cached16
    changed = list(toks)
    changed[BS + 1] = 77                            # a token of block 2 (1-based)
    probe = make_seq(changed + [1], "p")
    assert bm.match_prefix(probe) == BS
    assert probe.block_table == base.block_table[:1]


def test_same_block_after_different_prefix_does_not_hit(cached16):
    bm, _, toks = cached16
    probe = make_seq([99, 99, 99, 99] + toks[BS:] + [1], "p")   # blocks 2..4 equal, block 1 not
    assert bm.match_prefix(probe) == 0
    assert probe.block_table == []


@pytest.mark.parametrize("n,expect", [(16, 12), (17, 16), (13, 12), (12, 8), (5, 4), (4, 0), (1, 0)])
def test_last_token_is_never_served_from_cache(cached16, n, expect):
    bm, _, toks = cached16
    extra = toks + [5]                              # 17 tokens; the 17th is never cached
    probe = make_seq(extra[:n], "p")
    assert bm.match_prefix(probe) == expect
    assert len(probe.block_table) == expect // BS


def test_match_prefix_skips_sequence_with_blocks_and_disabled_cache(cached16):
    bm, base, toks = cached16
    before = bm.num_prefix_queries
    assert bm.match_prefix(base) == 0              # already holds blocks
    off = BlockManager(8, BS, enable_prefix_caching=False)
    seq = make_seq(toks, "x")
    compute(off, seq)
    assert off.cached == {} and all(b.hash is None for b in off.blocks)
    assert off.match_prefix(make_seq(toks + [1], "y")) == 0
    assert off.num_prefix_queries == 0 and bm.num_prefix_queries == before


def test_a_cache_salt_shares_prefixes_only_with_the_same_salt(cached16):
    """vLLM's cache_salt: a salted prompt does not hit the unsalted blocks, a second prompt with
    the same salt hits the first's, another salt hits neither; unsalted requests are unchanged."""
    bm, base, toks = cached16

    def salted(salt, rid):
        return Sequence(rid, toks + [1], SamplingParams(cache_salt=salt))
    first = salted("tenant-a", "a1")
    assert bm.match_prefix(first) == 0
    compute(bm, first)
    again = salted("tenant-a", "a2")
    assert bm.match_prefix(again) == 4 * BS and again.block_table == first.block_table[:4]
    assert bm.match_prefix(salted("tenant-b", "b1")) == 0
    plain = make_seq(toks + [1], "p")
    assert bm.match_prefix(plain) == 4 * BS and plain.block_table == base.block_table[:4]
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")


def test_prefix_counters(cached16):
    bm, _, toks = cached16
    assert (bm.num_prefix_queries, bm.num_prefix_hits) == (0, 0)
    bm.match_prefix(make_seq(toks[:8] + [1], "a"))          # 9 queried, 8 hit
    bm.match_prefix(make_seq([42] * 6, "b"))                # 6 queried, 0 hit
    bm.match_prefix(make_seq(toks, "c"))                    # 16 queried, 12 hit
    assert bm.num_prefix_queries == 9 + 6 + 16
    assert bm.num_prefix_hits == 8 + 0 + 12


def test_register_only_full_computed_blocks():
    bm = BlockManager(8, BS)
    seq = make_seq(range(10))
    compute(bm, seq, 6)
    assert seq.num_hashed_blocks == 1
    assert bm.blocks[seq.block_table[0]].hash is not None
    assert bm.blocks[seq.block_table[1]].hash is None
    compute(bm, seq, 10)
    assert seq.num_hashed_blocks == 2
    assert bm.blocks[seq.block_table[2]].hash is None
    # KV reserved past the committed tokens (drafts) is never hashed
    assert bm.reserve(seq, 16)
    seq.num_computed = 16
    bm.register_full_blocks(seq)
    assert seq.num_hashed_blocks == 2


def test_revived_block_leaves_free_list(cached16):
    bm, base, toks = cached16
    table = list(base.block_table)
    bm.free_seq(base)
    assert set(table) <= set(bm.free)
    probe = make_seq(toks + [1], "p")
    assert bm.match_prefix(probe) == 16
    assert probe.block_table == table
    assert not set(table) & set(bm.free)
    assert all(bm.blocks[b].ref_count == 1 for b in table)
    check_invariants(bm, [probe])


# --- LRU eviction ---------------------------------------------------------------------------

def test_lru_eviction_oldest_freed_first():
    bm = BlockManager(4, 2)
    a, b = make_seq([1, 2, 3], "a"), make_seq([5, 6, 7], "b")
    compute(bm, a, 2)                               # one hashed block each
    compute(bm, b, 2)
    blk_a, blk_b = a.block_table[0], b.block_table[0]
    bm.free_seq(a)                                  # a freed before b: a is older
    bm.free_seq(b)
    assert len(bm.cached) == 2

    c = make_seq(range(4), "c")
    assert bm.reserve(c, 4)                         # the two never-cached blocks go first
    assert not {blk_a, blk_b} & set(c.block_table)
    assert len(bm.cached) == 2

    d = make_seq(range(2), "d")
    assert bm.reserve(d, 2)
    assert d.block_table == [blk_a]                 # oldest freed cached block evicted
    assert bm.blocks[blk_a].hash is None
    assert len(bm.cached) == 1

    probe_a = make_seq([1, 2, 3], "pa")
    assert bm.match_prefix(probe_a) == 0            # evicted hash no longer hits
    probe_b = make_seq([5, 6, 7], "pb")
    assert bm.match_prefix(probe_b) == 2
    assert probe_b.block_table == [blk_b]
    check_invariants(bm, [c, d, probe_a, probe_b])


def test_lru_refreshed_by_reuse():
    bm = BlockManager(2, 2)
    a, b = make_seq([1, 2, 3], "a"), make_seq([5, 6, 7], "b")
    compute(bm, a, 2)
    compute(bm, b, 2)
    blk_b = b.block_table[0]
    bm.free_seq(a)
    bm.free_seq(b)
    again = make_seq([1, 2, 3], "a2")               # a used again, freed last: now newest
    assert bm.match_prefix(again) == 2
    bm.free_seq(again)
    x = make_seq([0, 0], "x")
    assert bm.reserve(x, 2)
    assert x.block_table == [blk_b]
    assert bm.match_prefix(make_seq([1, 2, 3], "p")) == 2


def test_free_seq_evicts_tail_before_head():
    bm = BlockManager(3, BS)
    toks = list(range(12))
    seq = make_seq(toks + [0], "a")
    compute(bm, seq, 12)
    table = list(seq.block_table)
    bm.free_seq(seq)
    x = make_seq(range(4), "x")
    assert bm.reserve(x, 4)
    assert x.block_table == [table[2]]              # the tail is evicted first
    probe = make_seq(toks + [0], "p")
    assert bm.match_prefix(probe) == 8
    assert probe.block_table == table[:2]


def test_duplicate_content_is_not_double_cached():
    bm = BlockManager(8, BS)
    toks = list(range(8))
    a, b = make_seq(toks + [1], "a"), make_seq(toks + [1], "b")
    compute(bm, a, 8)
    compute(bm, b, 8)                               # computed concurrently, no sharing
    assert len(bm.cached) == 2
    check_invariants(bm, [a, b])
    bm.free_seq(a)
    bm.free_seq(b)
    # evicting every block leaves no dangling cache entries
    big = make_seq(range(32), "big")
    assert bm.reserve(big, 32)
    assert bm.cached == {}
    check_invariants(bm, [a, b, big])
