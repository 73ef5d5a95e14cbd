"""The prefix cache's second tier: a prefix evicted from the paged cache comes back from the
tier with prefill skipped and the same output (oracles: the same engine without the tier, and
the first run); LRU by bytes and the TTL on the tier itself."""
from __future__ import annotations

import pytest
import torch

from leapfrog import LLM, SamplingParams
from leapfrog.engine.kv_tiers import HostKVTier

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
LONG = [1] + list(range(20, 60))                 # 41 tokens: ten full blocks of 4
OTHERS = [[1] + list(range(100 + 40 * i, 140 + 40 * i)) for i in range(3)]


def _engine(llama_dir, **kw) -> LLM:
    return LLM(str(llama_dir), block_size=4, kv_cache_tokens=64, max_batch_size=1, **kw)


def test_an_evicted_prefix_comes_back_from_the_second_tier(llama_dir):
    plain, tiered = _engine(llama_dir), _engine(llama_dir, kv_spill_bytes=64 << 20)
    for llm in (plain, tiered):
        first = llm.generate([LONG], GREEDY)[0].token_ids
        for p in OTHERS:                          # 16 blocks of paged cache: LONG's are evicted
            llm.generate([p], GREEDY)
        again = llm.generate([LONG], GREEDY)[0]
        assert again.token_ids == first
        llm.result = (first, again)
    bm_plain, bm = plain.engine.block_manager, tiered.engine.block_manager
    assert bm_plain.num_tier_hits == 0 and plain.result[1].metrics.num_cached_prompt_tokens == 0
    assert bm.num_tier_hits == 40 and tiered.result[1].metrics.num_cached_prompt_tokens == 40
    assert tiered.result[0] == plain.result[0]                  # the tier changes no output
    assert bm.tier.num_saved > 0 and bm.tier.num_hits == 10


def test_tier_keeps_to_its_bytes_and_ttl():
    now = [0.0]
    k, v = torch.arange(32.0).view(8, 1, 4), -torch.arange(32.0).view(8, 1, 4)   # 4 blocks of 2 rows
    tier = HostKVTier(lambda: [(k, v)], block_size=2, capacity_bytes=2 * 2 * 2 * 4 * 4, ttl=10.0,
                      clock=lambda: now[0])
    tier.save(1, (5, 6), 0)
    tier.save(2, (7, 8), 1)
    tier.save(3, (9, 9), 2)                       # three blocks do not fit in two blocks' bytes
    assert list(tier.entries) == [2, 3] and tier.num_dropped == 1
    assert not tier.has(2, (7, 7))                # same hash, other tokens: not a hit
    k[6:8], v[6:8] = 0.0, 0.0
    assert tier.load(2, (7, 8), 3)                # block 1's rows, now in block 3
    assert torch.equal(k[6:8], k[2:4]) and torch.equal(v[6:8], v[2:4])
    now[0] = 11.0
    assert not tier.load(3, (9, 9), 0) and tier.num_expired == 1
    with pytest.raises(ValueError):
        HostKVTier(lambda: [], 2, -1)
