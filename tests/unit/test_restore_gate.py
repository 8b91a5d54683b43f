"""`cuda.RestoreGate`: how many driver restores go in at a time, and in which order (threads, no driver)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from volga_agent.snapshot import cuda


def wait_until(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < deadline, "the gate's threads did not get there"
        time.sleep(0.001)


class Caller(threading.Thread):
    """Goes through the gate, notes its entry, and stays inside until `leave` is set."""

    def __init__(self, gate: cuda.RestoreGate, k: int, entered: list[int]) -> None:
        super().__init__(daemon=True)
        self.gate, self.k, self.entered, self.leave = gate, k, entered, threading.Event()

    def run(self) -> None:
        with self.gate:
            self.entered.append(self.k)
            self.leave.wait(10)


def queue_up(gate: cuda.RestoreGate, n: int, entered: list[int]) -> list[Caller]:
    """n callers that ask one after another, each once the one before it waits."""
    callers = []
    for k in range(n):
        waiting = gate.counts()[1]
        callers.append(Caller(gate, k, entered))
        callers[-1].start()
        wait_until(lambda: gate.counts()[1] == waiting + 1)  # noqa: B023 (used within the iteration)
    return callers


def test_one_at_a_time_in_the_order_asked() -> None:
    gate, entered = cuda.RestoreGate(1), []
    with gate:
        callers = queue_up(gate, 5, entered)
        assert entered == [] and gate.counts() == (1, 5)
    for k, caller in enumerate(callers):
        wait_until(lambda: len(entered) == k + 1)  # noqa: B023
        assert entered == list(range(k + 1)) and gate.counts()[0] == 1
        caller.leave.set()
        caller.join()
    assert gate.counts() == (0, 0)


def test_at_most_k_inside() -> None:
    gate, entered = cuda.RestoreGate(2), []
    holders = [Caller(gate, k, entered) for k in (100, 101)]
    for holder in holders:
        holder.start()
    wait_until(lambda: len(entered) == 2)
    callers = queue_up(gate, 5, entered)
    assert gate.counts() == (2, 5)
    for holder in holders:
        holder.leave.set()
    wait_until(lambda: len(entered) == 4)
    assert entered[2:] == [0, 1] and gate.counts() == (2, 3)
    callers[1].leave.set()
    wait_until(lambda: len(entered) == 5)
    assert entered[2:] == [0, 1, 2] and gate.counts() == (2, 2)
    for caller in [*holders, *callers]:
        caller.leave.set()
        caller.join()
    assert gate.counts() == (0, 0)


def test_a_lead_goes_in_alone_and_the_rest_together_after_it() -> None:
    gate, entered = cuda.RestoreGate(lead=True), []
    with gate:  # asked of an empty gate: the lead
        callers = queue_up(gate, 4, entered)
        assert entered == [] and gate.counts() == (1, 4)
    wait_until(lambda: len(entered) == 4)
    assert gate.counts() == (4, 0)  # all four inside at once
    late = Caller(gate, 9, entered)  # asks while others are inside: joins them
    late.start()
    wait_until(lambda: len(entered) == 5)
    for caller in [*callers, late]:
        caller.leave.set()
        caller.join()
    assert gate.counts() == (0, 0)


def test_no_limit_lets_everyone_in() -> None:
    gate, entered = cuda.RestoreGate(), []
    callers = [Caller(gate, k, entered) for k in range(3)]
    for caller in callers:
        caller.start()
    wait_until(lambda: len(entered) == 3)
    for caller in callers:
        caller.leave.set()
        caller.join()


def test_a_negative_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="restores_at_once: must be >= 0"):
        cuda.RestoreGate(-1)
