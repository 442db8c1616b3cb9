"""The decode host's bridge slots (``PD_BRIDGE_MAX_BRIDGES``) under every order of their events.

A slot is given back when its bridge is done and every I/O job it started has returned; those
events come from different threads in any order. Python has no shuttle or loom, so these tests
enumerate the orders themselves: every permutation of a bridge's done() and its jobs' completions,
and of two bridges' events interleaved, checking after each step that the count never leaves
[0, limit] and is back to zero at the end. Threads then run the same shape for real."""

from __future__ import annotations

import concurrent.futures
import itertools
import threading

import pytest

from pd_bridge_omlx.bridge import _Slots


def _events(slots: _Slots, jobs: int, tag: str):
    """A bridge taking a slot and starting ``jobs`` I/O jobs: its later events, as (name, fn)."""
    slot = slots.try_take()
    assert slot is not None
    futs = [concurrent.futures.Future() for _ in range(jobs)]
    for f in futs:
        slot.hold(f)
    events = [(f"{tag}.job{i}", (lambda f=f: f.set_result(None))) for i, f in enumerate(futs)]
    events.append((f"{tag}.done", slot.done))
    return slot, events


@pytest.mark.parametrize("jobs", [0, 1, 2, 3])
def test_one_bridge_gives_its_slot_back_once_in_every_order(jobs):
    n = 0
    for order in itertools.permutations(range(jobs + 1)):
        slots = _Slots(1)
        _, events = _events(slots, jobs, "a")
        for k, i in enumerate(order):
            assert slots.in_flight == 1, (order, k)
            events[i][1]()
        assert slots.in_flight == 0, order
        assert slots.try_take() is not None, order
        n += 1
    assert n == len(list(itertools.permutations(range(jobs + 1))))


def test_two_bridges_interleaved_in_every_order_never_leave_the_bounds():
    orders = 0
    for a_order in itertools.permutations(range(3)):
        for b_order in itertools.permutations(range(2)):
            # Every interleaving of a's three events with b's two, each side in its own order.
            for picks in set(itertools.permutations("aaabb")):
                slots = _Slots(2)
                _, a = _events(slots, 2, "a")
                _, b = _events(slots, 1, "b")
                assert slots.try_take() is None  # at the limit
                seq = {"a": iter(a_order), "b": iter(b_order)}
                for side in picks:
                    (a if side == "a" else b)[next(seq[side])][1]()
                    assert 0 <= slots.in_flight <= 2
                assert slots.in_flight == 0
                orders += 1
    assert orders == 6 * 2 * 10


def test_a_slot_refuses_io_after_it_was_given_back_and_a_second_done_is_harmless():
    slots = _Slots(1)
    slot = slots.try_take()
    slot.done()
    slot.done()
    assert slots.in_flight == 0
    with pytest.raises(RuntimeError, match="after its slot was given back"):
        slot.hold(concurrent.futures.Future())
    assert slots.in_flight == 0


def test_many_threads_taking_and_releasing_stay_within_the_limit():
    slots = _Slots(4)
    seen = []
    lock = threading.Lock()
    pool = concurrent.futures.ThreadPoolExecutor(8)

    def bridge():
        slot = slots.try_take()
        if slot is None:
            return False
        with lock:
            seen.append(slots.in_flight)
        jobs = [pool.submit(lambda: None) for _ in range(3)]
        for j in jobs:
            slot.hold(j)
        slot.done()
        return True

    with concurrent.futures.ThreadPoolExecutor(16) as bridges:
        admitted = sum(bridges.map(lambda _: bridge(), range(400)))
    pool.shutdown(wait=True)
    assert admitted >= 1 and all(1 <= s <= 4 for s in seen), (admitted, max(seen))
    assert slots.in_flight == 0
