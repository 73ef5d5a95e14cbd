"""Waiting in line for a place: the couplets written at once, the engine's running batch.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import asyncio
import bisect
import itertools
import math
import time
from typing import Callable

MIN_EVENTS = 3          # saturated completions before the measured rate replaces the prior


class DrainRate:
    """Places freed per second while all are taken (see the module's docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, tau_s: float = 10.0,
                 prior: float | None = None) -> None:
        self.clock, self.tau_s, self.prior = clock, tau_s, prior
        self.busy_s = 0.0            # decayed seconds with every place taken
        self.done = 0.0              # decayed completions in those seconds
        self.events = 0
        self.saturated = False
        self._t = clock()

    def _advance(self) -> None:
        now = self.clock()
        dt = max(0.0, now - self._t)
        self._t = now
        if dt == 0.0:
            return
        decay = math.exp(-dt / self.tau_s)
        self.done *= decay
        # decayed as the completions are (the latest interval at full weight, like the latest completion)
        self.busy_s = self.busy_s * decay + (dt if self.saturated else 0.0)

    def set_saturated(self, saturated: bool) -> None:
        if saturated != self.saturated:
            self._advance()
            self.saturated = saturated

    def completed(self) -> None:
        """A place freed up (call before the place is handed on or left empty)."""
        self._advance()
        if self.saturated:
            self.done += 1.0
            self.events += 1

    def rate(self) -> float | None:
        self._advance()
        if self.events >= MIN_EVENTS and self.busy_s > 0.0:
            return self.done / self.busy_s
        return self.prior

    def wait_s(self, position: int) -> float | None:
        """Expected seconds until the `position`-th in line (1 = next) gets a place; None when
        the rate is not known yet."""
        rate = self.rate()
        return None if rate is None or rate <= 0.0 else position / rate


class LineFull(Exception):
    """The line is longer than its bound: come back after `retry_s` (None: unknown)."""

    def __init__(self, retry_s: float | None, reason: str) -> None:
        super().__init__(reason)
        self.retry_s, self.reason = retry_s, reason


def retry_after_s(wait_s: float | None) -> int:
    """A Retry-After header's whole seconds for an expected wait (1 s when unknown)."""
    return max(1, math.ceil(wait_s)) if wait_s is not None else 1


class Ticket:
    """A request's place in a WaitingLine: `number` orders the line; `turn` resolves when it
    holds a place."""
    __slots__ = ("number", "turn", "line", "holding")

    def __init__(self, number: int, turn: asyncio.Future, line: "WaitingLine") -> None:
        self.number, self.turn, self.line, self.holding = number, turn, line, False

    @property
    def position(self) -> int:
        """1 for the next in line; 0 once it holds a place."""
        return 0 if self.turn.done() else self.line.position(self)

    def expected_wait_s(self) -> float | None:
        return 0.0 if self.turn.done() else self.line.drain.wait_s(self.position)


class WaitingLine:
    """`places` held at once; the rest wait in order while their expected wait is at most
    `max_wait_s` (and the line is at most `max_waiting` long, when given).

    join() -> Ticket (or LineFull); `await wait_for_turn(ticket)`; release(ticket) when done,
    from any exit: a ticket still waiting leaves the line, one holding a place hands it on."""

    def __init__(self, places: int, max_wait_s: float, prior_rate: float | None = None,
                 max_waiting: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.places, self.max_wait_s, self.max_waiting = places, max_wait_s, max_waiting
        self.drain = DrainRate(clock, prior=prior_rate)
        self.in_use = 0
        self._numbers = itertools.count()
        self._waiting: list[int] = []                # ticket numbers, in order
        self._tickets: dict[int, Ticket] = {}
        self._promised = -math.inf                   # the turn promised to the last one turned away

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def position(self, ticket: Ticket) -> int:
        return bisect.bisect_left(self._waiting, ticket.number) + 1

    def expected_wait_s(self) -> float:
        """What a request joining now would wait (0 with a place free)."""
        if self.in_use < self.places and not self._waiting:
            return 0.0
        wait = self.drain.wait_s(len(self._waiting) + 1)
        return math.inf if wait is None else wait

    def join(self) -> Ticket:
        loop = asyncio.get_running_loop()
        ticket = Ticket(next(self._numbers), loop.create_future(), self)
        if self.in_use < self.places and not self._waiting:
            self._take(ticket)
            return ticket
        position = len(self._waiting) + 1
        wait = self.drain.wait_s(position)
        if wait is not None and wait > self.max_wait_s:
            rate = position / wait
            raise LineFull(self._promise(wait, rate), f"{len(self._waiting)} are waiting and the line moves "
                           f"about {rate:.1f} a second: the wait would be {wait:.0f} s, more than "
                           f"{self.max_wait_s:g} s")
        if self.max_waiting is not None and len(self._waiting) >= self.max_waiting:
            raise LineFull(wait, f"{len(self._waiting)} are already waiting, the most the line holds")
        self._waiting.append(ticket.number)
        self._tickets[ticket.number] = ticket
        return ticket

    async def wait_for_turn(self, ticket: Ticket) -> None:
        """Until `ticket` holds a place; cancelled (a client gone), it leaves the line."""
        try:
            await asyncio.shield(ticket.turn)
        except BaseException:
            self.release(ticket)
            raise

    def release(self, ticket: Ticket) -> None:
        """The ticket's request is done (or gone): free its place, or its spot in line."""
        if ticket.holding:
            ticket.holding = False
            self.drain.completed()
            self.in_use -= 1
            self._hand_on()
        elif ticket.number in self._tickets:
            del self._tickets[ticket.number]
            del self._waiting[bisect.bisect_left(self._waiting, ticket.number)]
            if not ticket.turn.done():
                ticket.turn.cancel()
        self.drain.set_saturated(self.in_use >= self.places)

    def _promise(self, wait: float, rate: float) -> float:
        """When a request turned away should come back: half the bound before its turn, so that
        it finds a line it fits, ahead of its turn, and the line never runs empty while it is
        away. Its turn is its own had it joined, but never before the turn promised to the one
        turned away before it plus one place's time: those sent away together come back one
        after another, as places free up, not all at once."""
        now = self.drain.clock()
        turn = max(now + wait, self._promised + 1.0 / rate)
        self._promised = turn
        return max(1.0, turn - now - self.max_wait_s / 2)

    def _take(self, ticket: Ticket) -> None:
        ticket.holding = True
        self.in_use += 1
        ticket.turn.set_result(None)
        self.drain.set_saturated(self.in_use >= self.places)

    def _hand_on(self) -> None:
        while self._waiting and self.in_use < self.places:
            ticket = self._tickets.pop(self._waiting.pop(0))
            if not ticket.turn.done():           # a cancelled waiter is skipped
                self._take(ticket)
