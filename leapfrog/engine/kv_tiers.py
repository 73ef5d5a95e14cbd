"""The prefix cache's second tier: KV blocks evicted from the model's paged cache, kept
elsewhere (host memory next to a GPU; on a CPU, more of the same memory than the paged cache
holds), least-recently-used first out, each for at most `ttl` seconds.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import logging
import queue
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch

log = logging.getLogger("leapfrog.engine.kv_tiers")

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


MAGIC = b"LFKV1"


def pack_block(tokens: tuple[int, ...], rows: list[torch.Tensor]) -> bytes:
    """MAGIC, the token count and tokens (int32), then each tensor's bytes in cache order."""
    head = MAGIC + struct.pack("<I", len(tokens)) + struct.pack(f"<{len(tokens)}i", *tokens)
    return head + b"".join(r.contiguous().view(torch.uint8).numpy().tobytes() for r in rows)


def unpack_tokens(payload: bytes) -> tuple[tuple[int, ...], int] | None:
    """(tokens, offset of the first tensor), or None for a payload that is not a block."""
    if len(payload) < len(MAGIC) + 4 or not payload.startswith(MAGIC):
        return None
    (n,) = struct.unpack_from("<I", payload, len(MAGIC))
    start = len(MAGIC) + 4
    if len(payload) < start + 4 * n:
        return None
    return struct.unpack_from(f"<{n}i", payload, start), start + 4 * n


class RedisKVTier:
    """Blocks shared through Redis. `namespace` names the model and KV layout (EngineConfig's
    fingerprint of the weights, the KV dtype and the block size); keys are
    `leapfrog:kv:<namespace>:<chain hash>`, values pack_block()'s bytes, each with a TTL."""

    def __init__(self, caches: Caches, block_size: int, url: str, namespace: str, ttl: float = 3600.0,
                 client: Any = None, retry_after: float = 5.0, timeout: float = 0.25,
                 max_pending: int = 4096, clock: Callable[[], float] = time.monotonic) -> None:
        try:
            # deferred: redis is an optional extra, needed only with kv_remote_url
            import redis
        except ImportError:
            raise ValueError("kv_remote_url needs the redis client: pip install redis") from None
        self._errors = (redis.RedisError, OSError)
        self.caches, self.block_size, self.url = caches, block_size, url
        self.ttl, self.retry_after, self.clock = ttl, retry_after, clock
        # Reads wait `timeout` at most (a step waits on them); connecting may take longer.
        self.client = client or redis.Redis.from_url(url, socket_timeout=timeout,
                                                     socket_connect_timeout=max(timeout, 2.0))
        self.prefix = f"leapfrog:kv:{namespace}:".encode()
        self._down_until = 0.0
        self._outage = False
        self._fetched: tuple[bytes, bytes] | None = None      # (key, payload) of the last has()
        self._pending: queue.Queue = queue.Queue(max_pending)
        self.num_published = self.num_hits = self.num_misses = self.num_errors = self.num_dropped = 0
        self._writer = threading.Thread(target=self._write_loop, name="leapfrog-kv-redis", daemon=True)
        self._writer.start()

    def _key(self, key: int) -> bytes:
        return self.prefix + b"%x" % (key & 0xFFFFFFFFFFFFFFFF)

    def _rows(self, block_id: int) -> slice:
        return slice(block_id * self.block_size, (block_id + 1) * self.block_size)

    # --- failing fast and logging once -----------------------------------------------------
    @property
    def available(self) -> bool:
        return self.clock() >= self._down_until

    def _call(self, fn: Callable[[], Any]) -> Any:
        if not self.available:
            return None
        try:
            result = fn()
        except self._errors as exc:
            self.num_errors += 1
            self._down_until = self.clock() + self.retry_after
            if not self._outage:
                self._outage = True
                log.warning("the shared KV tier at %s is unreachable (%s): serving from this replica's own "
                            "tiers, retrying every %gs", self.url, exc, self.retry_after)
            return None
        if self._outage:
            self._outage = False
            log.warning("the shared KV tier at %s answers again", self.url)
        return result

    # --- writes: copied now, sent by the writer thread ---------------------------------------
    def publish(self, key: int, tokens: tuple[int, ...], block_id: int) -> None:
        """A block just became full: share it (its rows are copied now, sent in the background)."""
        if not self.available:
            return
        rows = self._rows(block_id)
        copies = [t[rows].to("cpu", copy=True) for k, v in self.caches() for t in (k, v)]
        try:
            self._pending.put_nowait((self._key(key), tokens, copies))
        except queue.Full:                  # Redis slower than decoding: drop, never block a step
            self.num_dropped += 1

    def _write_loop(self) -> None:
        ttl = max(1, int(round(self.ttl)))
        # Connect now, off the engine's thread: the first lookup then finds a connection in the
        # pool instead of paying for one (on a busy machine that took longer than a read may).
        self._call(self.client.ping)
        while True:
            item = self._pending.get()
            if item is None:
                return
            key, tokens, copies = item
            if self._call(lambda: self.client.set(key, pack_block(tokens, copies), ex=ttl)) is not None:
                self.num_published += 1
            self._pending.task_done()

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until the writes queued so far are sent (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._pending.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        self._pending.put(None)

    # --- reads ------------------------------------------------------------------------------
    def has(self, key: int, tokens: tuple[int, ...]) -> bool:
        k = self._key(key)
        payload = self._call(lambda: self.client.get(k))
        if not payload:
            self.num_misses += 1
            return False
        head = unpack_tokens(payload)
        if head is None or head[0] != tokens:
            self.num_misses += 1
            return False
        self._fetched = (k, payload)
        return True

    def load(self, key: int, tokens: tuple[int, ...], block_id: int) -> bool:
        """Copy the block has() just fetched into `block_id`'s rows; False if it does not fit."""
        k = self._key(key)
        if self._fetched is None or self._fetched[0] != k:
            if not self.has(key, tokens):
                return False
        payload = self._fetched[1]
        self._fetched = None
        _, offset = unpack_tokens(payload)
        rows = self._rows(block_id)
        targets = [t for k_, v_ in self.caches() for t in (k_, v_)]
        sizes = [t[rows].numel() * t.element_size() for t in targets]
        if len(payload) - offset != sum(sizes):       # another layout under the same name
            self.num_misses += 1
            return False
        for t, n in zip(targets, sizes):
            block = torch.frombuffer(bytearray(payload[offset:offset + n]), dtype=torch.uint8)
            t[rows] = block.view(t.dtype).view(t[rows].shape).to(t.device)
            offset += n
        self.num_hits += 1
        return True

    def stats(self) -> dict[str, int]:
        return {"published": self.num_published, "hits": self.num_hits, "misses": self.num_misses,
                "errors": self.num_errors, "dropped": self.num_dropped}
