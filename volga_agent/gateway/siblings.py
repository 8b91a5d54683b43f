"""More than one gateway process on one node's ports.

A gateway under grpc.aio does its work on one event loop in one process, and most of that work is grpc.aio's own
(its completion-queue poller thread and the loop's wake-ups, about 85 % of the gateway's CPU per small request by a
py-spy profile; docs/measurements.md, "Against KServe"): at around a thousand small requests a second one gateway
process holds a core. `volga-gateway --processes N` and `volga up --gateway-processes N` run N gateway processes on
the same HTTP and gRPC ports. Each binds them with SO_REUSEPORT and the kernel spreads incoming connections over the
processes by a hash of each connection's addresses: one client connection stays with one process, several
connections (several clients, or a client's channel pool) spread. Each process has its own route cache, batchers and
load exchange with the agent (which sums what every gateway process pushes), and its own /metrics: the metrics port
+ its index, or a port of its own when the metrics port is 0. Prometheus sums the processes' series like any other
instances.

The first process (index 0) starts the others (`Siblings`) and keeps them running: one that exits is started again
after a pause (1 s, doubling up to 30 s while it keeps exiting within a minute of its start). They end with it: the
kernel sends them SIGTERM when it goes (PR_SET_PDEATHSIG, `die_with_parent`), and `stop` sends SIGTERM and, 5 s
later, SIGKILL.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

# The command line of a gateway process, before its arguments (`volga-gateway`'s entry point, as this interpreter).
GATEWAY_MAIN = (sys.executable, "-c",
                "import sys; from volga_agent.app.daemons import gateway_main; sys.exit(gateway_main())")
PR_SET_PDEATHSIG = 1
READY = re.compile(r"^volga-gateway: .* metrics :(\d+)")
FIRST_PAUSE_SEC, LAST_PAUSE_SEC, STABLE_SEC = 1.0, 30.0, 60.0
PARENT_ENV = "VOLGA_GATEWAY_PARENT"  # the pid of process 0, in the environment of the others


def die_with_parent() -> None:
    """In a gateway process 1..N-1: get SIGTERM when process 0 goes, and exit now if it already went. (Set here
    rather than between fork and exec, which would make the spawn a plain fork of a process with gRPC's threads.)"""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):
        sys.exit(f"gateway process 0 (pid {parent}) is gone")


@dataclasses.dataclass
class Sibling:
    index: int
    proc: subprocess.Popen[str] | None = None
    metrics_port: int = 0
    started: float = 0.0
    quick_exits: int = 0  # exits in a row within STABLE_SEC of a start: the pause before the next start doubles


class SiblingFailed(RuntimeError):
    """A gateway process did not start (it exited, or did not listen in time): its last output says why."""


class Siblings:
    """Gateway processes 1 .. count-1 beside this one: `command(i)` is the command line of process i but for its
    metrics port, which is `metrics_port` + i, or with `metrics_port` 0 a free one, the same again after a restart."""

    def __init__(self, command: Callable[[int], Sequence[str]], count: int, metrics_port: int = 0,
                 start_timeout: float = 60.0) -> None:
        self.command = command
        self.metrics_port = metrics_port
        self.start_timeout = start_timeout
        self.siblings = [Sibling(i) for i in range(1, count)]
        self._stopping = threading.Event()
        self._watch: threading.Thread | None = None

    def start(self) -> None:
        """Start every sibling and wait until each listens; then watch them. SiblingFailed if one does not."""
        try:
            for sibling in self.siblings:
                self._spawn(sibling)
        except BaseException:
            self.stop()
            raise
        if self.siblings:
            self._watch = threading.Thread(target=self._keep, name="gateway-siblings", daemon=True)
            self._watch.start()

    def metrics_ports(self) -> list[int]:
        return [s.metrics_port for s in self.siblings]

    def _spawn(self, sibling: Sibling) -> None:
        port = self.metrics_port + sibling.index if self.metrics_port else sibling.metrics_port
        proc = subprocess.Popen([*self.command(sibling.index), "--metrics-port", str(port)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1,
                                env={**os.environ, PARENT_ENV: str(os.getpid())})
        sibling.proc, sibling.started = proc, time.monotonic()
        ready = threading.Event()
        tail: collections.deque[str] = collections.deque(maxlen=20)

        def relay() -> None:  # its output, prefixed, into ours; the ready line gives its metrics port
            assert proc.stdout is not None
            for line in proc.stdout:
                tail.append(line)
                match = READY.match(line)
                if match and not ready.is_set():
                    sibling.metrics_port = int(match.group(1))
                    ready.set()
                print(f"[gateway {sibling.index}] {line}", end="", file=sys.stderr, flush=True)

        threading.Thread(target=relay, name=f"gateway-{sibling.index}-output", daemon=True).start()
        deadline = time.monotonic() + self.start_timeout
        while not ready.wait(0.05):
            if proc.poll() is not None or time.monotonic() > deadline:
                what = f"exited ({proc.returncode})" if proc.poll() is not None else "did not listen in time"
                proc.kill()  # one that hangs is not left holding the ports; the watch starts it again
                proc.wait()
                raise SiblingFailed(f"gateway process {sibling.index} {what}:\n" + "".join(tail))

    def _keep(self) -> None:
        while not self._stopping.wait(0.5):
            for sibling in self.siblings:
                proc = sibling.proc
                if proc is None or proc.poll() is None:
                    continue
                lived = time.monotonic() - sibling.started
                sibling.quick_exits = 0 if lived > STABLE_SEC else sibling.quick_exits + 1
                pause = min(FIRST_PAUSE_SEC * 2 ** max(0, sibling.quick_exits - 1), LAST_PAUSE_SEC)
                log.warning("gateway process %d (pid %d) exited (%s) after %.1f s; starting it again in %.0f s",
                            sibling.index, proc.pid, proc.returncode, lived, pause)
                if self._stopping.wait(pause):
                    return
                try:
                    self._spawn(sibling)
                except SiblingFailed as exc:
                    log.warning("%s", exc)

    def stop(self, grace: float = 5.0) -> None:
        self._stopping.set()
        if self._watch is not None:
            self._watch.join(timeout=grace + LAST_PAUSE_SEC)
        running = [s.proc for s in self.siblings if s.proc is not None and s.proc.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in running:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
