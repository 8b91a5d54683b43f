"""A CPU duty cycle for workers: how the autonomy loop stops a tolerant co-runner's CPU use outright while a less
tolerant model needs protection (docs/architecture.md, "The SLO contract and the autonomy loop").

A lowered priority (`priority`) does nothing while a core is free for the co-runner, and two workers on two cores
still share caches and memory bandwidth. So each period the cycle stops every target's process (SIGSTOP: all its
threads) for the target's share of the period, then continues it (SIGCONT) for at least the rest. Signals and not
a cgroup: the agent owns no CPU cgroup of its own on a cgroup v1 node (nor in most containers), and CRIU records a
process's cgroups in its image, so a worker dumped while in a throttled cgroup would come back throttled. Signals
stop a process in any PID namespace and on any kernel, and stop nothing else.

A stopped worker is never left stopped:

- every target names a lock (its instance's, under which every tier move runs) that the cycle holds for as long as
  it keeps the worker stopped, so no move (a CRIU dump would record a stopped process, and restore it stopped) can
  start then; a move waits for the end of the stop phase, a share of one period at most;
- which process to stop is read under that lock (`Target.pid`), so a worker frozen, restored or gone is never
  signalled by its old PID;
- a target dropped, and `close`, continue its worker at once;
- the agent's death kills a stopped worker all the same (its parent-death signal is SIGKILL, which a stopped
  process takes).

A request that reaches a stopped worker waits for the end of the stop phase: a share of one period at most, and the
share is what the co-runner's own tolerance allows (the autonomy loop's decider caps it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Target:
    """One worker the cycle may stop: `lock` is held while it is stopped; `pid` (called under it) names the
    process to stop now, or None (not running, or not to be touched now)."""

    lock: threading.Lock
    pid: Callable[[], int | None]
    share: float  # of each period the worker spends stopped, in [0, 1)


def resume(pid: int) -> None:
    """Continue process `pid` if it is stopped (a no-op on a running one); a process gone is left alone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def stopped(pid: int) -> bool:
    """Whether process `pid` is stopped by a signal now (for checks)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(") ", 1)[1][0] == "T"
    except (OSError, IndexError):
        return False


@dataclasses.dataclass
class _Held:
    key: str
    pid: int
    lock: threading.Lock
    until: float  # when the stop phase ends (monotonic)
    share: float


class DutyCycle:
    """Stops and continues the targets of each key on a thread of its own, one period after another."""

    def __init__(self, period_s: float) -> None:
        if not 0.001 <= period_s <= 10.0:
            raise ValueError(f"period: must be between 1 ms and 10 s, got {period_s * 1e3:g} ms")
        self.period = period_s
        self._targets: dict[str, tuple[Target, ...]] = {}
        self._mutex = threading.Lock()  # guards _targets and _held
        self._released = threading.Condition(self._mutex)  # a held worker was continued
        self._held: list[_Held] = []
        self._changed = threading.Event()  # targets dropped or added, or closing
        self._closing = False
        self._thread: threading.Thread | None = None
        self.stops = 0  # workers stopped so far, one per worker and period

    def set(self, key: str, targets: Sequence[Target]) -> None:
        """The targets of `key` from the next period on (none: as `drop`)."""
        for target in targets:
            if not 0.0 <= target.share < 1.0:
                raise ValueError(f"share: must be at least 0 and below 1, got {target.share:g}")
        with self._mutex:
            if self._closing:
                raise RuntimeError("the duty cycle is closed")
            if targets:
                self._targets[key] = tuple(targets)
            else:
                self._targets.pop(key, None)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="throttle", daemon=True)
                self._thread.start()
        self._changed.set()

    def drop(self, key: str, timeout: float = 1.0) -> None:
        """`key`'s workers run freely again: those stopped now are continued before this returns."""
        with self._mutex:
            self._targets.pop(key, None)
        self._changed.set()
        with self._released:
            if not self._released.wait_for(lambda: all(h.key != key for h in self._held), timeout):
                for held in self._held:  # the thread is late: continue them all the same
                    if held.key == key:
                        resume(held.pid)

    def keys(self) -> frozenset[str]:
        with self._mutex:
            return frozenset(self._targets)

    def close(self, timeout: float = 5.0) -> None:
        """Continue every stopped worker and end the thread."""
        with self._mutex:
            self._closing = True
            self._targets.clear()
            thread = self._thread
        self._changed.set()
        if thread is not None:
            thread.join(timeout)
        with self._mutex:  # the thread did not end in time: continue what it holds all the same
            for held in self._held:
                resume(held.pid)

    def _stop_phase(self, start: float) -> list[_Held]:
        """Stop every target whose lock is free and that names a process; they are held until their phase ends."""
        held: list[_Held] = []
        with self._mutex:
            targets = [(key, target) for key, items in self._targets.items() for target in items]
        for key, target in targets:
            if target.share <= 0.0 or not target.lock.acquire(blocking=False):
                continue  # a tier move (or a check) holds the instance: it runs this period
            try:
                pid = target.pid()
            except BaseException:
                target.lock.release()
                raise
            entry = None if pid is None else self._stop(key, pid, target, start)
            if entry is None:
                target.lock.release()
                continue
            held.append(entry)
            self.stops += 1
        held.sort(key=lambda h: h.until)
        return held

    def _stop(self, key: str, pid: int, target: Target, start: float) -> _Held | None:
        """Stop `pid` and hold it, unless its key was dropped meanwhile (under the mutex: a `drop` that returned
        has no worker of its key stopped, nor will have)."""
        with self._mutex:
            if key not in self._targets:
                return None
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                return None
            except PermissionError as exc:
                log.warning("cannot stop worker %d of %s: %s", pid, key, exc)
                return None
            entry = _Held(key, pid, target.lock, start + target.share * self.period, target.share)
            self._held.append(entry)
            return entry

    def _release(self, entry: _Held) -> float:
        resume(entry.pid)
        with self._mutex:
            self._held.remove(entry)
            self._released.notify_all()
        entry.lock.release()
        # It runs at least the rest of a period before it is stopped again.
        return time.monotonic() + (1.0 - entry.share) * self.period

    def _run(self) -> None:
        try:
            while True:
                with self._mutex:
                    if self._closing:
                        return
                    idle = not self._targets
                if idle:
                    self._changed.wait()
                    self._changed.clear()
                    continue
                start = time.monotonic()
                self._changed.clear()
                held = self._stop_phase(start)
                next_start = start + self.period
                while held:
                    entry = held[0]
                    delay = entry.until - time.monotonic()
                    if delay > 0 and self._changed.wait(delay):
                        self._changed.clear()
                        with self._mutex:
                            live = set() if self._closing else set(self._targets)
                        for gone in [h for h in held if h.key not in live]:
                            held.remove(gone)
                            next_start = max(next_start, self._release(gone))
                        continue
                    held.pop(0)
                    next_start = max(next_start, self._release(entry))
                # The run phase: only closing cuts it short (new targets wait for the next period).
                while (delay := next_start - time.monotonic()) > 0 and self._changed.wait(delay):
                    self._changed.clear()
                    with self._mutex:
                        if self._closing:
                            return
        finally:
            with self._mutex:
                left = list(self._held)
                for entry in left:
                    resume(entry.pid)
                self._held.clear()
                self._released.notify_all()
            for entry in left:
                entry.lock.release()
