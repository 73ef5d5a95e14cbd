"""The prefix cache's second tier: KV blocks evicted from the model's paged cache, kept
elsewhere (host memory next to a GPU; on a CPU, more of the same memory than the paged cache
holds), least-recently-used first out, each for at most `ttl` seconds.

The block manager (block_manager.py) calls `save` when it evicts a cached block (its chained
hash and tokens still name its contents) and `load` when a prompt's prefix misses the first tier
but this one has the block: the rows are copied back into a free block and attached as if they
had never left, so prefill skips them and the output is the same. Entries are keyed by the chain
hash and checked against their tokens. A third tier shared between replicas (Redis, LMCache's and
Mooncake's design) would sit behind this one with the same two calls.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

Caches = Callable[[], list[tuple[torch.Tensor, torch.Tensor]]]


@dataclass(slots=True)
class _Entry:
    tokens: tuple[int, ...]
    rows: list[torch.Tensor]               # per layer: keys, then values, [block_size, heads, dim]
    stored: float
    nbytes: int


class HostKVTier:
    def __init__(self, caches: Caches, block_size: int, capacity_bytes: int, ttl: float = 600.0,
                 device: torch.device | str = "cpu", clock: Callable[[], float] = time.monotonic) -> None:
        if capacity_bytes < 0 or ttl <= 0:
            raise ValueError("kv_spill_bytes must be >= 0 and kv_spill_ttl > 0")
        self.caches, self.block_size = caches, block_size
        self.capacity, self.ttl, self.device, self.clock = capacity_bytes, ttl, torch.device(device), clock
        self.entries: OrderedDict[int, _Entry] = OrderedDict()
        self.nbytes = 0
        self.num_saved = self.num_hits = self.num_misses = self.num_expired = self.num_dropped = 0

    def _rows(self, block_id: int) -> slice:
        return slice(block_id * self.block_size, (block_id + 1) * self.block_size)

    def save(self, key: int, tokens: tuple[int, ...], block_id: int) -> None:
        """Keep a copy of an evicted block's rows (every layer's keys and values)."""
        rows = self._rows(block_id)
        copies = [t[rows].to(self.device, copy=True) for k, v in self.caches() for t in (k, v)]
        size = sum(c.numel() * c.element_size() for c in copies)
        if size > self.capacity:
            return
        self._drop(key)
        self.entries[key] = _Entry(tokens, copies, self.clock(), size)
        self.nbytes += size
        self.num_saved += 1
        while self.nbytes > self.capacity:
            self._drop(next(iter(self.entries)))
            self.num_dropped += 1

    def has(self, key: int, tokens: tuple[int, ...]) -> bool:
        e = self.entries.get(key)
        if e is not None and self.clock() - e.stored > self.ttl:
            self._drop(key)
            self.num_expired += 1
            return False
        return e is not None and e.tokens == tokens

    def load(self, key: int, tokens: tuple[int, ...], block_id: int) -> bool:
        """Copy a kept block back into `block_id`'s rows; False (nothing written) if it is not here."""
        if not self.has(key, tokens):
            self.num_misses += 1
            return False
        e = self.entries[key]
        rows = self._rows(block_id)
        for (k, v), kc, vc in zip(self.caches(), e.rows[0::2], e.rows[1::2]):
            k[rows] = kc.to(k.device)
            v[rows] = vc.to(v.device)
        self.entries.move_to_end(key)
        self.num_hits += 1
        return True

    def _drop(self, key: int) -> None:
        e = self.entries.pop(key, None)
        if e is not None:
            self.nbytes -= e.nbytes

    def stats(self) -> dict[str, int]:
        return {"blocks": len(self.entries), "bytes": self.nbytes, "saved": self.num_saved,
                "hits": self.num_hits, "expired": self.num_expired, "dropped": self.num_dropped}
