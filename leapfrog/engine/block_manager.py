"""Paged KV blocks: allocate / append / truncate (rollback) / free with reference counts, and
prefix caching by chained hashes of full blocks.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from leapfrog.sequence import Sequence

if TYPE_CHECKING:
    from leapfrog.engine.kv_tiers import HostKVTier, RedisKVTier


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


ROOT = -1      # the chain's parent of a first block: CPython's hash() never returns -1


def chain_hash(prev: int | None, token_ids: tuple[int, ...]) -> int:
    """A block's identity: its tokens and everything before them. Hashes of int tuples are the
    same in every process (unlike hash(None), which 3.11 derives from an address), so replicas
    sharing the third tier name a prefix alike."""
    return hash((ROOT if prev is None else prev, token_ids))


def chain_root(seq: Sequence) -> int | None:
    """The parent of a sequence's first block: ROOT, or for a request with a cache_salt (vLLM's)
    a digest of the salt, so that only requests with the same salt share cached prefixes (one
    tenant cannot time another's prompts through the cache). A stable digest, not hash(): str
    hashes differ between processes, and replicas sharing the third tier must agree."""
    salt = seq.params.cache_salt
    if salt is None:
        return None
    root = int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little", signed=True)
    return root if root != ROOT else ROOT - 1


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 tier: "HostKVTier | None" = None, remote: "RedisKVTier | None" = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}       # chain hash -> block id
        self.num_prefix_queries = 0            # tokens looked up in the prefix cache
        self.num_prefix_hits = 0               # tokens found there (in either tier)
        self.tier = tier if enable_prefix_caching else None
        self.num_tier_hits = 0                 # tokens of those found in the second tier
        self.remote = remote if enable_prefix_caching else None
        self.num_remote_hits = 0               # tokens of those found in the third tier

    # --- accounting -------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, seq: Sequence, num_slots: int) -> int:
        return max(0, -(-num_slots // self.block_size) - len(seq.block_table))

    # --- allocation ---------------------------------------------------------------------
    def _take(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]         # evict: its contents are about to change
            if self.tier is not None:
                self.tier.save(block.hash, block.token_ids, block_id)
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks holding a prefix of `seq`'s tokens; returns tokens reused.
        At least one token is always left to compute, so the step that follows has logits."""
        if not self.enable_prefix_caching or seq.block_table or seq.params.prompt_logprobs is not None:
            return 0          # (prompt logprobs need every prompt position's logits computed)
        bs = self.block_size
        max_blocks = (len(seq.token_ids) - 1) // bs
        prev: int | None = chain_root(seq)
        self.num_prefix_queries += len(seq.token_ids)
        for i in range(max_blocks):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(prev, tokens)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                if not self._from_tier(seq, h, tokens):
                    break
                prev = h
                continue
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            prev = h
        reused = len(seq.block_table) * bs
        seq.num_hashed_blocks = len(seq.block_table)
        self.num_prefix_hits += reused
        return reused

    def _from_tier(self, seq: Sequence, h: int, tokens: tuple[int, ...]) -> bool:
        """A block the second tier kept, or else the third, copied back into a free block and
        attached to `seq`."""
        if not self.free:
            return False
        for tier in (self.tier, self.remote):
            if tier is None or not tier.has(h, tokens):
                continue
            block_id = self._take()
            if not tier.load(h, tokens, block_id):
                self._release(block_id)
                continue
            block = self.blocks[block_id]
            block.hash, block.token_ids = h, tokens
            self.cached[h] = block_id
            seq.block_table.append(block_id)
            if tier is self.tier:
                self.num_tier_hits += self.block_size
            else:
                self.num_remote_hits += self.block_size
            return True
        return False

    def reserve(self, seq: Sequence, num_slots: int) -> bool:
        """Grow `seq`'s block table to hold `num_slots` tokens; all or nothing."""
        need = self.blocks_needed(seq, num_slots)
        if need > len(self.free):
            return False
        seq.block_table.extend(self._take() for _ in range(need))
        return True

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Roll back: release blocks past the first `num_tokens` slots (rejected drafts)."""
        keep = -(-num_tokens // self.block_size)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())
        full = num_tokens // self.block_size
        if full < len(seq.block_table):          # a partly kept block will be overwritten:
            block = self.blocks[seq.block_table[full]]     # its old hash must stop hitting
            if block.hash is not None and self.cached.get(block.hash) == block.block_id:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
        seq.num_hashed_blocks = min(seq.num_hashed_blocks, full)

    def free_seq(self, seq: Sequence) -> None:
        # Release in reverse so that a sequence's tail blocks are evicted before its head,
        # which other prompts are more likely to share.
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table.clear()
        seq.num_hashed_blocks = 0

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} released twice"
        if block.ref_count == 0:
            if block.hash is None:
                self.free[block_id] = None
                self.free.move_to_end(block_id, last=False)   # uncached: reuse first
            else:
                self.free[block_id] = None                     # cached: most recent at tail

    # --- prefix cache -------------------------------------------------------------------
    def register_full_blocks(self, seq: Sequence) -> None:
        """Hash every block whose tokens are all computed and committed."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(min(seq.num_computed, len(seq.token_ids)) // bs, len(seq.block_table))
        i = seq.num_hashed_blocks
        prev = self.blocks[seq.block_table[i - 1]].hash if i else chain_root(seq)
        for i in range(i, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
                block.hash, block.token_ids = chain_hash(prev, tokens), tokens
                self.cached.setdefault(block.hash, block.block_id)
                if self.remote is not None:
                    self.remote.publish(block.hash, tokens, block.block_id)
            prev = block.hash
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, num_full)
