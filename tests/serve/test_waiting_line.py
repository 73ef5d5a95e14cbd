"""The waiting line (leapfrog/serve/line.py) on a fake clock: first come first served, the wait
bound, the Retry-After it implies, a cancelled waiter leaving at once, and the drain rate it is
all estimated from."""
from __future__ import annotations

import asyncio
import math

import pytest

from leapfrog.serve.line import MIN_EVENTS, DrainRate, LineFull, WaitingLine, retry_after_s


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(coro):
    return asyncio.run(coro)


async def settle() -> None:
    """Lets the tasks woken so far run (a shielded wait takes a few loop turns)."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_drain_rate_counts_only_completions_while_every_place_is_taken():
    clock = Clock()
    rate = DrainRate(clock, prior=2.0)
    assert rate.rate() == 2.0 and rate.wait_s(4) == 2.0         # the prior until it has seen enough
    for _ in range(10):                    # one place freed a second while not saturated: not the drain rate
        clock.now += 1.0
        rate.completed()
    assert rate.rate() == 2.0
    rate.set_saturated(True)
    for _ in range(MIN_EVENTS + 20):       # saturated: 4 completions a second
        clock.now += 0.25
        rate.completed()
    assert rate.rate() == pytest.approx(4.0, rel=0.03) and rate.wait_s(8) == pytest.approx(2.0, rel=0.03)
    rate.set_saturated(False)
    clock.now += 600.0                     # an idle spell keeps the last measured rate
    assert rate.rate() == pytest.approx(4.0, rel=0.03)
    rate.set_saturated(True)               # the load changes: the estimate follows within a minute or so
    for _ in range(400):
        clock.now += 0.5
        rate.completed()
    assert rate.rate() == pytest.approx(2.0, rel=0.01)


def test_no_prior_and_no_measurement_means_no_estimate():
    rate = DrainRate(Clock())
    assert rate.rate() is None and rate.wait_s(3) is None
    assert retry_after_s(None) == 1 and retry_after_s(0.2) == 1 and retry_after_s(7.01) == 8


def test_the_line_serves_in_order_bounds_the_wait_and_lets_the_gone_leave():
    async def main() -> None:
        clock = Clock()
        line = WaitingLine(places=2, max_wait_s=10.0, prior_rate=0.5, clock=clock)   # 2 s a place
        holders = [line.join(), line.join()]               # places free: taken at once
        assert all(t.turn.done() and t.position == 0 for t in holders) and line.in_use == 2
        assert line.expected_wait_s() == pytest.approx(2.0)
        waiting = [line.join() for _ in range(5)]          # 2, 4, 6, 8, 10 s: all fit the bound
        assert [t.position for t in waiting] == [1, 2, 3, 4, 5]
        assert [t.expected_wait_s() for t in waiting] == pytest.approx([2, 4, 6, 8, 10])
        with pytest.raises(LineFull) as full:              # the sixth would wait 12 s
            line.join()
        # back when its place would be half the bound (5 s) from the front: 12 - 5 s
        assert full.value.retry_s == pytest.approx(7.0) and retry_after_s(full.value.retry_s) == 7
        assert "12 s" in str(full.value) and line.num_waiting == 5    # turned away: not in the line
        promised = []
        for _ in range(3):                                 # turned away together: told turns a place apart
            with pytest.raises(LineFull) as full:
                line.join()
            promised.append(full.value.retry_s)
        assert promised == pytest.approx([9, 11, 13])
        clock.now += 20.0                                  # long after: the promises are past
        with pytest.raises(LineFull) as full:
            line.join()
        assert full.value.retry_s == pytest.approx(7.0)

        order: list[int] = []

        async def wait(k: int) -> None:
            await line.wait_for_turn(waiting[k])
            order.append(k)
        tasks = [asyncio.create_task(wait(k)) for k in range(5)]
        await settle()
        tasks[2].cancel()                                  # the third client goes away while waiting
        await settle()
        assert line.num_waiting == 4 and [t.position for t in waiting[3:]] == [3, 4]   # left at once
        line.release(holders[0])                           # a place frees: the first in line takes it
        await settle()
        assert order == [0] and line.in_use == 2 and waiting[0].position == 0
        for k in (1, 0):
            line.release(holders[k] if k else waiting[0])
            await settle()
        assert order == [0, 1, 3]
        for t in (waiting[1], waiting[3]):
            line.release(t)
        await settle()
        assert order == [0, 1, 3, 4] and tasks[2].cancelled()
        line.release(waiting[4])
        line.release(waiting[4])                           # a second release changes nothing
        assert line.in_use == 0 and line.num_waiting == 0
        assert line.expected_wait_s() == 0.0 and line.join().turn.done()
    run(main())


def test_a_waiter_cancelled_as_its_turn_comes_hands_the_place_on():
    async def main() -> None:
        line = WaitingLine(places=1, max_wait_s=math.inf, clock=Clock())
        first, second, third = line.join(), line.join(), line.join()
        t2 = asyncio.create_task(line.wait_for_turn(second))
        t3 = asyncio.create_task(line.wait_for_turn(third))
        await settle()
        line.release(first)                # second now holds the place...
        t2.cancel()                        # ...but its client is gone before it runs
        await settle()
        assert t2.cancelled() and t3.done() and third.holding and line.in_use == 1
    run(main())


def test_the_line_without_an_estimate_is_bounded_by_its_length_only():
    async def main() -> None:
        line = WaitingLine(places=1, max_wait_s=1.0, max_waiting=2, clock=Clock())
        line.join()
        line.join(), line.join()           # no rate known: the wait bound cannot apply
        with pytest.raises(LineFull) as full:
            line.join()
        assert full.value.retry_s is None and "already waiting" in str(full.value)
    run(main())


def test_saturation_follows_the_places_taken():
    async def main() -> None:
        clock = Clock()
        line = WaitingLine(places=2, max_wait_s=math.inf, clock=clock)
        a, b = line.join(), line.join()
        assert line.drain.saturated
        waiter = line.join()
        for _ in range(MIN_EVENTS + 1):    # each second a place frees and the next takes it
            clock.now += 1.0
            line.release(a)
            a = waiter
            waiter = line.join()
        assert line.drain.rate() == pytest.approx(1.0, rel=0.05)
        line.release(waiter)
        line.release(a)
        assert not line.drain.saturated
    run(main())


class _Engine:
    """What a Generation asks of the engine thread: places, the drain rate, submit and abort."""

    def __init__(self, places: int) -> None:
        self.places, self.num_in_flight, self.drain = places, 0, DrainRate()
        self.submitted, self.aborted = 0, []

    def submit(self, ids, params, sink, priority, arrival, stream) -> str:
        self.submitted += 1
        return f"r{self.submitted}"

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def test_requests_that_leave_move_the_line_on_as_finished_ones_do():
    """A client that hangs up (or times out, or fails) frees its place: the drain rate behind the
    429s counts it. Counting only finished requests once made a server whose streams were
    abandoned refuse the next request for a wait of 75 s when its place came in half a second."""
    from leapfrog.serve.engine_thread import Generation

    async def run() -> None:
        engine = _Engine(places=2)
        gens = [Generation(engine, [([1], None)]) for _ in range(2)]       # every place taken
        assert engine.drain.saturated
        gens[0].close()                                    # a client went away while every place was taken
        assert engine.aborted == ["r1"] and engine.drain.events == 1 and not engine.drain.saturated
        gens[1].close()
        failing = [Generation(engine, [([1], None)]) for _ in range(2)]
        failing[0]._sink.put_nowait(("r3", RuntimeError("its own fault")))      # full again, and one fails
        with pytest.raises(RuntimeError):
            async for _ in failing[0].outputs():
                pass
        assert engine.drain.events == 2
    asyncio.run(run())
