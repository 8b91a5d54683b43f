"""A CPU duty cycle for workers (and model servers' trees): how the autonomy loop stops a tolerant co-runner's CPU
use outright while a less tolerant model needs protection (docs/architecture.md, "The SLO contract and the autonomy
loop"). A target's PID may be a process group's, negated as kill(2) takes it: a model server's tree, stopped whole.

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

Guarded (`guarded=True`), the targets stop only while the models they give way to have work in flight: the
gateway calls `enter` as it hands a request of any model that is not a target to a worker, and `leave` when the
answer is back (`protects` says which). The first `enter` of a run of them stops the targets on the gateway's own
thread, the last `leave` continues them, and the cycle's thread continues them earlier when their share of a
period is spent; after a stop a target runs for at least as long as keeps its stopped time within its share. So
a co-runner stops exactly while the protected model computes, where sharing a core's caches (or its sibling
hyperthread) would slow it, and runs freely between its requests: it loses about the protected model's busy share
of its time, not the whole throttle share. The same invariants hold: the instance's lock is held while stopped.
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
    """Stops and continues the targets of each key on a thread of its own, one period after another; guarded, only
    while protected work is in flight (`enter`, `leave`), within each target's share."""

    def __init__(self, period_s: float, guarded: bool = False) -> None:
        if not 0.001 <= period_s <= 10.0:
            raise ValueError(f"period: must be between 1 ms and 10 s, got {period_s * 1e3:g} ms")
        self.period = period_s
        self.guarded = guarded
        # Guarded: protected requests in flight, the stops they made (held until the last is answered or the
        # share is spent), when those began, and when the targets may be stopped again.
        self._busy = 0
        self._busy_lock = threading.Lock()  # taken before `_mutex`, never after it
        self._guard_held: list[_Held] = []
        self._guard_start = 0.0
        self._next_stop = 0.0
        self._holding = threading.Event()  # set while a guard stop holds workers
        self._guard_over = threading.Event()  # set when it ends
        self._poke = threading.Event()  # set only by `close`: the guarded thread's timed waits end
        self._keys: frozenset[str] = frozenset()  # the targets' keys, read without the mutex by `protects`
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
            self._keys = frozenset(self._targets)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch if self.guarded else self._run, name="throttle",
                                                daemon=True)
                self._thread.start()
        self._changed.set()

    def drop(self, key: str, timeout: float = 1.0) -> None:
        """`key`'s workers run freely again: those stopped now are continued before this returns."""
        with self._mutex:
            self._targets.pop(key, None)
            self._keys = frozenset(self._targets)
        self._changed.set()
        if self.guarded:
            with self._busy_lock:
                self._guard_release(key)
        with self._released:
            if not self._released.wait_for(lambda: all(h.key != key for h in self._held), timeout):
                for held in self._held:  # the thread is late: continue them all the same
                    if held.key == key:
                        resume(held.pid)

    def keys(self) -> frozenset[str]:
        return self._keys

    def protects(self, key: str) -> bool:
        """Guarded: whether a request of `key` makes the targets stop (some are set, and `key` is none of them)."""
        keys = self._keys
        return self.guarded and bool(keys) and key not in keys

    def enter(self) -> None:
        """Guarded: a protected request is handed to its worker. The first of a run of them stops the targets at
        once, on the caller's thread (a hand-over to the cycle's thread would wait for Python's lock, up to
        milliseconds of the request it protects), unless they have yet to run long enough to stay within
        their share; so it costs a few system calls on the request path."""
        with self._busy_lock:
            self._busy += 1
            if self._busy == 1:
                self._guard_stop()

    def leave(self) -> None:
        """Guarded: a protected request was answered (or failed); the last of them continues the targets."""
        with self._busy_lock:
            self._busy -= 1
            if self._busy == 0:
                self._guard_release()

    def _guard_stop(self) -> None:
        """Stop the targets for protected work, if none are held and they have run long enough; under
        `_busy_lock`."""
        now = time.monotonic()
        if self._guard_held or now < self._next_stop:
            return
        held = self._stop_phase(now)
        if held:
            self._guard_held, self._guard_start = held, now
            self._guard_over.clear()
            self._holding.set()

    def _guard_release(self, key: str | None = None) -> None:
        """Continue what a guard stop holds (of `key` only, when given); under `_busy_lock`."""
        for entry in [h for h in self._guard_held if key is None or h.key == key]:
            self._guard_held.remove(entry)
            self._next_stop = max(self._next_stop, self._release(entry, self._guard_start))
        if not self._guard_held:
            self._holding.clear()
            self._guard_over.set()

    def _watch(self) -> None:
        """Guarded: continue the workers of a guard stop once their share of the period is spent, and stop them
        again once they have run long enough, while protected work is still in flight."""
        while True:
            with self._mutex:
                if self._closing:
                    return
            with self._busy_lock:
                until = min((h.until for h in self._guard_held), default=None)
                busy, next_stop = self._busy, self._next_stop
            now = time.monotonic()
            if until is not None:  # held: until the work is done or the share is spent
                if until > now and self._guard_over.wait(until - now):
                    continue
                with self._busy_lock:
                    if self._guard_held and min(h.until for h in self._guard_held) <= time.monotonic():
                        self._guard_release()
            elif busy and next_stop > now:  # protected work goes on: stop them again once they have run enough
                self._poke.wait(next_stop - now)
            elif busy:
                with self._busy_lock:
                    if self._busy:
                        self._guard_stop()
                if not self._holding.is_set():  # none to stop now (moving, or not HOT): not before a period
                    self._poke.wait(self.period)
            else:
                self._holding.wait(self.period)  # until `enter` stops them

    def close(self, timeout: float = 5.0) -> None:
        """Continue every stopped worker and end the thread."""
        with self._mutex:
            self._closing = True
            self._targets.clear()
            self._keys = frozenset()
            thread = self._thread
        self._changed.set()
        self._holding.set()  # a guarded thread's waits end
        self._poke.set()
        if thread is not None:
            thread.join(timeout)
        if self.guarded:
            with self._busy_lock:
                self._guard_release()
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

    def _release(self, entry: _Held, stopped_at: float | None = None) -> float:
        """Continue a held worker; when it may be stopped again. It runs at least the rest of a period, or, for
        a guarded stop that began at `stopped_at`, long enough to keep its stopped time within its share."""
        resume(entry.pid)
        with self._mutex:
            self._held.remove(entry)
            self._released.notify_all()
        entry.lock.release()
        now = time.monotonic()
        if stopped_at is not None:
            return now + (now - stopped_at) * (1.0 - entry.share) / entry.share
        return now + (1.0 - entry.share) * self.period

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
