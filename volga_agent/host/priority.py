"""A worker's CPU priority, lowered and given back: how the autonomy loop makes a tolerant model's worker yield a
shared CPU to the least tolerant models' workers (docs/architecture.md, "The SLO contract and the autonomy loop").

Linux keeps a nice value per thread, so every thread of the worker (/proc/PID/task) is set. Where the kernel groups
processes by session for scheduling (autogroup: on unless the processes live in a CPU cgroup of their own), every
worker is a session leader (worker/nsinit.py) and so a group of its own, whose weight against the other workers
only the group's nice sets (/proc/PID/autogroup): both are set. CRIU dumps and restores each thread's nice with
it, so the instance gives a restored worker (a model server's instance: each process of its restored tree) its
normal priority back (`normalise`).

A nice value alone still lets a busy low-priority thread run out its time slice when a normal thread wakes (a few
ms, on every wake-up of the protected model's request path); `idle` also puts the threads under SCHED_IDLE, which
any waking normal thread preempts at once.
"""

from __future__ import annotations

import dataclasses
import logging
import os

log = logging.getLogger(__name__)
MAX_NICE = 19


@dataclasses.dataclass(frozen=True)
class Applied:
    """What one change reached: the worker's threads set, and whether its session's group was set too."""

    threads: int
    group: bool


def normal() -> int:
    """The nice a worker starts with: the agent's own, which its workers inherit when spawned."""
    return os.getpriority(os.PRIO_PROCESS, 0)


def set_nice(pid: int, nice: int, idle: bool = False) -> Applied:
    """Every thread of process `pid` at `nice` (under SCHED_IDLE with `idle`, else SCHED_OTHER), and its session's
    scheduling group at `nice` (0 at the least: a group above normal priority needs privileges the agent may not
    have). ProcessLookupError when `pid` is gone; PermissionError when raising a priority needs CAP_SYS_NICE and the
    agent lacks it."""
    if not -20 <= nice <= MAX_NICE:
        raise ValueError(f"nice: must be between -20 and {MAX_NICE}, got {nice}")
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        raise ProcessLookupError(pid) from None
    threads = 0
    for tid in tids:
        try:
            _set_policy(int(tid), idle)
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        threads += 1
    if not threads:
        raise ProcessLookupError(pid)
    return Applied(threads, _set_group(pid, max(0, nice)))


def restore(pid: int) -> Applied:
    """Back to normal priority (`normal()`, SCHED_OTHER), threads and group."""
    return set_nice(pid, normal())


def _set_policy(tid: int, idle: bool) -> None:
    policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
    if os.sched_getscheduler(tid) != policy:
        os.sched_setscheduler(tid, policy, os.sched_param(0))


def normalise(pid: int) -> None:
    """`restore`, where needed and where it can: a process whose main thread runs at normal priority was not
    lowered (a yield lowers every thread), so two system calls settle the common case on a restore's path; a
    process gone is left alone, and one the agent may not raise stays as it is (logged)."""
    try:
        if os.getpriority(os.PRIO_PROCESS, pid) == normal() and os.sched_getscheduler(pid) != os.SCHED_IDLE:
            return
        restore(pid)
    except ProcessLookupError:
        return
    except PermissionError as exc:
        log.warning("worker %d keeps the priority its image holds: %s", pid, exc)


def _set_group(pid: int, nice: int) -> bool:
    """The autogroup's nice, where the kernel has autogroups; False where it has none (or refused: without
    CAP_SYS_ADMIN it takes one change per 100 ms across the node)."""
    try:
        with open(f"/proc/{pid}/autogroup", "w") as group:
            group.write(str(nice))
    except (FileNotFoundError, BlockingIOError, PermissionError):
        return False
    return True


def nice_of(pid: int) -> tuple[int, ...]:
    """The nice of each thread of `pid` (for checks and the debug log)."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out.append(os.getpriority(os.PRIO_PROCESS, int(tid)))
        except ProcessLookupError:
            continue
    return tuple(out)


def idle_threads_of(pid: int) -> int:
    """How many threads of `pid` run under SCHED_IDLE (for checks)."""
    count = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            count += os.sched_getscheduler(int(tid)) == os.SCHED_IDLE
        except ProcessLookupError:
            continue
    return count


def group_nice_of(pid: int) -> int | None:
    """The nice of `pid`'s autogroup ("/autogroup-N nice K"), None where there is none."""
    try:
        with open(f"/proc/{pid}/autogroup") as group:
            return int(group.read().split()[-1])
    except (FileNotFoundError, ValueError, IndexError):
        return None
