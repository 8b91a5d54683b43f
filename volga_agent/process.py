"""Worker processes: starting one through `nsinit`, watching it, and reaping it.

The agent is a child subreaper, so every worker it launches (and every one CRIU restores) is re-parented to
it: the agent reaps them with waitpid, and a PID it did not fork (a restored worker before re-parenting, or
after another reaper took it) is judged by /proc. The tier machine (`instance`) uses these functions; they
know nothing of tiers (see docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from volga_agent.worker import contract, nsinit

# onnxruntime's telemetry keeps a SQLite store under ~/.cache open, shared by every onnxruntime process of
# the user: when another process grows its journal between a worker's dump and its restore, CRIU refuses the
# restore ("has bad size"). A worker holds no file that others write.
WORKER_ENV = {"ORT_DISABLE_TELEMETRY": "1"}


class WorkerStartError(RuntimeError):
    """The worker died or did not become ready; the message carries the end of its log."""


def command(config_path: pathlib.Path, logfile: pathlib.Path, pid_namespace: bool,
            cpus: tuple[int, ...] = ()) -> list[str]:
    """The worker's command line: nsinit (a new PID namespace unless told otherwise, pinned to `cpus`)
    running `python -m volga_agent.worker.serve CONFIG.json`, its output in `logfile`."""
    return [sys.executable, "-m", "volga_agent.worker.nsinit",
            *([] if pid_namespace else ["--no-pidns"]),
            *(["--cpus", ",".join(map(str, cpus))] if cpus else []), str(logfile), "--",
            sys.executable, "-m", "volga_agent.worker.serve", str(config_path)]


def spawn(name: str, config: contract.WorkerConfig, workdir: pathlib.Path, logfile: pathlib.Path,
          pid_namespace: bool) -> int:
    """Start a worker for `config` with an empty signal folder; its PID, once nsinit has detached it."""
    signals = pathlib.Path(config.signal_dir)
    signals.mkdir(parents=True, exist_ok=True)
    for leftover in signals.iterdir():
        leftover.unlink()
    config_path = workdir / "config.json"
    config_path.write_text(config.to_json())
    nsinit.become_subreaper()
    out = subprocess.run(command(config_path, logfile, pid_namespace, config.cpus), capture_output=True,
                         text=True, check=False, cwd=workdir, env={**os.environ, **WORKER_ENV})
    if out.returncode != 0:
        raise WorkerStartError(f"{name}: could not start worker: {out.stderr.strip()}")
    return int(out.stdout.strip())


def alive(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return os.path.exists(f"/proc/{pid}") and not is_zombie(pid)
    return done == 0


def exited(pid: int, grace: float) -> bool:
    """Whether the process is gone; a process whose socket just closed may need a moment to exit."""
    deadline = time.monotonic() + grace
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def wait_for(name: str, pid: int, predicate: Callable[[], bool], what: str, timeout: float,
             signals: pathlib.Path, logfile: pathlib.Path) -> None:
    """Wait until `predicate` holds; WorkerStartError if the worker reports a failure, exits or times out."""
    deadline = time.monotonic() + timeout
    delay = 0.0005
    failed = signals / contract.FAILED
    while not predicate():
        if failed.exists():
            raise WorkerStartError(f"{name}: worker failed: {failed.read_text()}")
        if not alive(pid):
            raise WorkerStartError(f"{name}: worker exited before {what}:\n{log_tail(logfile)}")
        if time.monotonic() > deadline:
            raise WorkerStartError(f"{name}: worker not {what} after {timeout:.0f} s")
        time.sleep(delay)
        delay = min(delay * 2, 0.01)


def reap(pid: int, timeout: float = 10.0) -> None:
    """Collect an exiting child; one still there after `timeout` is killed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        time.sleep(0.002)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def kill(pid: int) -> None:
    """SIGKILL the process and reap it, so that no zombie is left."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    reap(pid)


def is_zombie(pid: int) -> bool:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return True


def log_tail(path: pathlib.Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
