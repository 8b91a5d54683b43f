"""Worker processes: starting one through `nsinit`, watching it, reaping it, and cleaning up after a crash.

The agent is a child subreaper, so every worker it launches (and every one CRIU restores) is re-parented to
it: the agent reaps them with waitpid, and a PID it did not fork (a restored worker before re-parenting, or
after another reaper took it) is judged by /proc. The tier machine (`instance`) uses these functions; they
know nothing of tiers (see docs/architecture.md).

A worker dies with the agent (nsinit arms PR_SET_PDEATHSIG). What an agent killed with SIGKILL can still
leave (a worker paused for a dump, a half-restored tree, criu itself, temporary images, work folders) is
proven to be an agent's by its `Owner`: every process the agent starts carries the owner's token in its
environment (`OWNER_ENV`), every folder it makes holds it in a marker file (`OWNER_FILE`). The token names
the boot, the PID namespace, the PID and the PID's start time, so a later agent can tell that its owner is
dead, and never mistakes a reused PID for it. `kill_orphans` and `remove_abandoned` then clean up. A worker
restored from an image another agent wrote (shared snapshots) carries that agent's token: the marker of its work
folder, its cwd, names the live agent that adopted it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable

from volga_agent.worker import contract, nsinit

# onnxruntime's telemetry keeps a SQLite store under ~/.cache open, shared by every onnxruntime process of
# the user: when another process grows its journal between a worker's dump and its restore, CRIU refuses the
# restore ("has bad size"). A worker holds no file that others write.
WORKER_ENV = {"ORT_DISABLE_TELEMETRY": "1"}
# The owner's token in the environment of every process the agent starts, and the marker file of its folders.
OWNER_ENV = "VOLGA_OWNER"
OWNER_FILE = ".volga-owner"


class WorkerStartError(RuntimeError):
    """The worker died or did not become ready; the message carries the end of its log."""


@dataclasses.dataclass(frozen=True)
class Owner:
    """The process that owns workers, images and folders, named so that it can be told dead after it is gone."""

    boot_id: str
    pid_ns: str
    pid: int
    start: int  # clock ticks after boot (/proc/PID/stat field 22): a reused PID has another

    @property
    def token(self) -> str:
        return f"{self.boot_id}/{self.pid_ns}/{self.pid}/{self.start}"

    @classmethod
    def parse(cls, token: str) -> Owner | None:
        parts = token.strip().split("/")
        if len(parts) != 4 or not parts[2].isdigit() or not parts[3].isdigit():
            return None
        return cls(parts[0], parts[1], int(parts[2]), int(parts[3]))

    def gone(self) -> bool:
        """Proven dead: another boot, or (in our PID namespace) its PID is free or taken by a later process.
        An owner in another PID namespace cannot be judged from here and is never gone."""
        if self.boot_id != _boot_id():
            return True
        if self.pid_ns != _pid_ns():
            return False
        return start_time(self.pid) != self.start


@functools.cache
def _boot_id() -> str:
    return pathlib.Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def _pid_ns() -> str:
    return os.readlink("/proc/self/ns/pid").removeprefix("pid:[").removesuffix("]")


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat from field 3 (the state) on; None when the process does not exist."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[19]) if fields else None


def parent(pid: int) -> int | None:
    """The parent's PID of process `pid` (None when it does not exist)."""
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def cpu_ticks(pid: int) -> int:
    """User and system CPU time of process `pid` so far, all its threads, in clock ticks (0 when it is gone)."""
    fields = _stat(pid)
    return int(fields[11]) + int(fields[12]) if fields else 0


def minor_faults(pid: int) -> int | None:
    """The minor page faults of process `pid`'s threads so far (None when it does not exist)."""
    fields = _stat(pid)
    return int(fields[7]) if fields else None


def cpu_seconds(pid: int) -> float:
    """`cpu_ticks` in seconds."""
    return cpu_ticks(pid) / os.sysconf("SC_CLK_TCK")


def me() -> Owner:
    """This process as an owner."""
    pid = os.getpid()
    start = start_time(pid)
    assert start is not None
    return Owner(_boot_id(), _pid_ns(), pid, start)


def settled() -> None:
    """Called once a long-running process has started (imported, set up, serving): what it holds so far leaves the
    garbage collector's view (`gc.freeze`), so that a full collection later scans only what came since instead of
    every module's objects. Such a collection holds the interpreter's lock on whatever thread it falls, a wake's
    included: 14-21 ms for the agent's modules on a 2-vCPU machine, 70-99 ms in a bench process with torch imported
    on an H200 machine (bench/restore_timeline.py)."""
    gc.collect()
    gc.freeze()


def dying_with_parent(args: list[str]) -> list[str]:
    """`args` run through `setpriv --pdeathsig KILL` where it is installed: the process is killed when the one that
    started it goes. Not a `preexec_fn`: Python code between fork and exec can deadlock in a process with other
    threads (gRPC's, say), and did, hanging a Popen for good."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", *args] if setpriv else args


def owned_env() -> dict[str, str]:
    """The environment of a process this one starts: its own, marked with this process's owner token."""
    return {**os.environ, OWNER_ENV: me().token}


def claim(folder: pathlib.Path) -> None:
    """Mark a folder this process made as its own, so a later agent may remove it once this one is dead."""
    (folder / OWNER_FILE).write_text(me().token)


def abandoned(folder: pathlib.Path) -> bool:
    """Whether a folder carries an owner marker whose owner is dead. A folder without one is nobody's."""
    try:
        owner = Owner.parse((folder / OWNER_FILE).read_text())
    except OSError:
        return False
    return owner is not None and owner.gone()


def remove_abandoned(folders: Iterable[pathlib.Path]) -> list[pathlib.Path]:
    """Remove the folders that are abandoned (see `abandoned`); the ones removed."""
    removed = []
    for folder in folders:
        if folder.is_dir() and not folder.is_symlink() and abandoned(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _owner_of(pid: int) -> Owner | None:
    """The owner token in a process's environment, if it has one."""
    try:
        environ = pathlib.Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    prefix = f"{OWNER_ENV}=".encode()
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            return Owner.parse(entry[len(prefix):].decode(errors="replace"))
    return None


def orphans() -> list[int]:
    """Processes started by an agent that is dead: their environment holds the token of a gone owner."""
    found = []
    me_pid = os.getpid()
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me_pid:
            continue
        owner = _owner_of(int(entry.name))
        if owner is not None and owner.gone() and not _adopted(int(entry.name)):
            found.append(int(entry.name))
    return sorted(found)


def _adopted(pid: int) -> bool:
    """A worker restored from an image another agent wrote (a shared snapshot) keeps that agent's token in its
    environment; its work folder (its cwd) names the live agent that restored it."""
    try:
        owner = Owner.parse((pathlib.Path(f"/proc/{pid}/cwd") / OWNER_FILE).read_text())
    except OSError:
        return False
    return owner is not None and not owner.gone()


def kill_orphans() -> list[int]:
    """SIGKILL every process a dead agent left behind (`orphans`); their PIDs."""
    killed = orphans()
    for pid in killed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return killed


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in pathlib.Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def open_files(pid: int) -> list[str]:
    """What the process's descriptors name, as /proc/PID/fd shows it (a path, socket:[INODE], anon_inode:...); none
    for a process gone or not ours to read."""
    found = []
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                found.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return found


def tree(pid: int) -> list[int]:
    """The process and its descendants, parents first."""
    found = [pid]
    for current in found:
        found += [c for c in children(current) if c not in found]
    return found


def kill_tree(pid: int, reap_root: bool = True) -> list[int]:
    """SIGKILL a process and every descendant it has; reap the root (unless the caller waits for it, as for a
    subprocess.Popen) and then the descendants that its death handed to us, the subreaper.

    The tree is stopped while it is collected, so that nothing in it forks, or dies and hands its children
    to another reaper, between collecting and killing."""
    seen: list[int] = []
    while True:
        new = [p for p in tree(pid) if p not in seen]
        if not new:
            break
        for p in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGSTOP)
        seen += new
    for p in reversed(seen):
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    if reap_root:
        reap(pid)
    else:
        deadline = time.monotonic() + 10.0
        while not is_zombie(pid) and time.monotonic() < deadline:
            time.sleep(0.002)
    for p in seen[1:]:
        reap(p, timeout=2.0)
    return seen


def rss(pid: int) -> int:
    """Resident bytes of a process (0 when it is gone)."""
    try:
        return int(pathlib.Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def command(config_path: pathlib.Path, logfile: pathlib.Path, pid_namespace: bool,
            cpus: tuple[int, ...] = (), die_with_agent: bool = True) -> list[str]:
    """The worker's command line: nsinit (a new PID namespace unless told otherwise, pinned to `cpus`, killed
    when the agent dies unless `die_with_agent` is off) running `python -m volga_agent.worker.serve CONFIG.json`,
    its output in `logfile`."""
    return [sys.executable, "-m", "volga_agent.worker.nsinit",
            *([] if pid_namespace else ["--no-pidns"]),
            *([] if die_with_agent else ["--keep"]),
            *(["--cpus", ",".join(map(str, cpus))] if cpus else []), str(logfile), "--",
            sys.executable, "-m", "volga_agent.worker.serve", str(config_path)]


def spawn(name: str, config: contract.WorkerConfig, workdir: pathlib.Path, logfile: pathlib.Path,
          pid_namespace: bool, die_with_agent: bool = True) -> int:
    """Start a worker for `config` with an empty signal folder; its PID, once nsinit has detached it."""
    signals = pathlib.Path(config.signal_dir)
    signals.mkdir(parents=True, exist_ok=True)
    for leftover in signals.iterdir():
        leftover.unlink()
    hand_over(signals, config)
    config_path = workdir / "config.json"
    config_path.write_text(config.to_json())
    nsinit.become_subreaper()
    out = subprocess.run(command(config_path, logfile, pid_namespace, config.cpus, die_with_agent),
                         capture_output=True, text=True, check=False, cwd=workdir, env={**owned_env(), **WORKER_ENV})
    if out.returncode != 0:
        raise WorkerStartError(f"{name}: could not start worker: {out.stderr.strip()}")
    return int(out.stdout.strip())


CAP_SYS_RESOURCE = 24


def _has_capability(bit: int) -> bool:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> bit & 1)
    return False


def must_stay_root(pid_namespace: bool, snapshots: bool, unprivileged_snapshots: bool = False) -> str:
    """Why a worker cannot drop to its own user here ('' when it can): CRIU, to dump it, mounts /proc from inside
    a worker's own PID namespace (CAP_SYS_ADMIN in the worker) and reads its rlimits (CAP_SYS_RESOURCE in the
    agent, over a worker of another user). Workers that may be snapshotted drop only with
    `unprivileged_snapshots`: their dumps and restores as another user are not proven yet (docs/security.md)."""
    if not snapshots:
        return ""
    if not unprivileged_snapshots:
        return "it may be snapshotted, and settings.unprivileged_snapshots is off"
    if pid_namespace:
        return "criu mounts /proc from inside the worker's PID namespace, which needs CAP_SYS_ADMIN in the worker"
    if os.geteuid() == 0 and not _has_capability(CAP_SYS_RESOURCE):
        return "criu reads the rlimits of a worker of another user, which needs CAP_SYS_RESOURCE, missing here"
    return ""


def hand_over(folder: pathlib.Path, config: contract.WorkerConfig) -> None:
    """Give a folder the worker writes in (its signals, its parked weights) to the user it runs as."""
    if (config.uid or config.gid) and os.geteuid() == 0:
        os.chown(folder, config.uid, config.gid)


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
            raise WorkerStartError(f"{name}: worker failed: {contract.read_signal(failed)}")
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
    fields = _stat(pid)
    return fields is None or fields[0] == "Z"


def log_tail(path: pathlib.Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
