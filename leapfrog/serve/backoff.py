"""How long a client turned away at capacity should wait: the Retry-After of a shed request.

A fixed "retry in a second" makes every waiting client come back every second: with 200 users
and room for 24, the server spends its cores answering ~180 429s a second, which slows the
requests it did admit. ``RetryAdvice`` instead aims at clients returning about as fast as places
free up. If W clients are waiting and places free up at the completion rate C, waiting
W / C seconds brings them back at C a second, which is what the server can admit. Each waiting
client is turned away once per wait, so the sheds of the last R seconds (R the current advice)
count W; C is measured over the last few seconds. R moves a third of the way to W / C per second
(so a burst does not swing it) within [low, high] seconds, and falls back to ``low`` once
nothing is shed. Each advice is R times a random factor in [0.8, 1.2], so clients turned away
together do not all come back together.
"""
from __future__ import annotations

import random
import time
from collections import deque
from typing import Callable


class RetryAdvice:
    def __init__(self, low: int = 1, high: int = 30, window_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, seed: int = 0) -> None:
        self.low, self.high, self.window_s, self.clock = low, high, window_s, clock
        self.rng = random.Random(seed)
        self.sheds: deque[float] = deque()
        self.completions: deque[float] = deque()
        self.seconds = float(low)
        self.updated = clock()

    def finished(self) -> None:
        """An admitted request completed (a place freed up)."""
        self.completions.append(self.clock())

    def shed(self) -> int:
        """A request was turned away: record it and return the Retry-After to send, in seconds."""
        now = self.clock()
        self.sheds.append(now)
        self._update(now)
        return max(self.low, min(self.high, round(self.seconds * self.rng.uniform(0.8, 1.2))))

    def current(self) -> int:
        """The advice now, without recording a shed."""
        self._update(self.clock())
        return round(self.seconds)

    def _update(self, now: float) -> None:
        elapsed = now - self.updated
        if elapsed < 1.0:
            return
        while self.sheds and self.sheds[0] < now - self.high:
            self.sheds.popleft()
        while self.completions and self.completions[0] < now - self.window_s:
            self.completions.popleft()
        horizon = max(self.seconds, 1.0)
        waiting = sum(1 for t in self.sheds if t >= now - horizon)
        done_rate = max(len(self.completions), 1) / self.window_s
        target = waiting / done_rate
        step = 1 - (2 / 3) ** min(elapsed, 30.0)
        self.seconds = min(self.high, max(self.low, self.seconds + step * (target - self.seconds)))
        self.updated = now
