"""Start a command as the init of a new PID namespace, detached, and print its PID.

CRIU restores a process with its original PID. Two restores of the same image, or a restore while the
dumped process's PID is taken, collide ("Can't fork for PID: File exists"). A worker that is the init of
its own PID namespace carries that namespace into the image, and CRIU recreates it on restore, so every
restore gets fresh PIDs and never collides.

The launcher unshares the PID namespace, forks (the child is PID 1 inside), makes the child a session
leader with its output in a log file, prints the child's PID as seen from outside, and exits. The child is
then re-parented to the nearest child subreaper: the agent, which reaps it.

With `--no-pidns` the child is only detached (for CUDA workers: the CUDA runtime fails with
cudaErrorOperatingSystem inside a PID namespace whose /proc is the host's). Such a worker is restored with
its original host PID, which must then be free; if it is not, the restore fails and the agent falls back
to a cold start.

The wake signal (SIGUSR1, `WAKE_SIGNAL`) is blocked before the exec, so the worker starts with it blocked
and every thread it ever has inherits that, including the ones numpy's BLAS starts while it is imported,
before the worker's own code runs. The worker's main thread takes the signal with sigtimedwait; a thread that
did not block it would receive it instead and die of it (outside a PID namespace), or drop it (as a
namespace's init, which ignores signals it has no handler for).

The child dies with the agent: once the launcher has exited and the child is re-parented to the agent (a
child subreaper), it arms PR_SET_PDEATHSIG with SIGKILL (`die_with`), unless `--keep` says the worker is to
outlive its agent. CRIU dumps that setting and restores it in the restored process while criu is its parent,
so the restored worker would be killed the moment criu exits and hands it to the agent: the worker therefore
disarms it before a checkpoint (`release_parent`) and arms it again, against the agent, after the restore.

With `--cpus 0,1,...` the child is pinned to those CPUs before it executes the command, so every thread
the worker starts (numpy's and the framework's included, some of which start at import) inherits the mask:
numaAffinity keeps a worker on the NUMA node of its GPU.

With `--init INIT DIR` the namespace's init is INIT (tini), working in DIR, and the command its child, working
where the launcher was started (through `/usr/bin/env --chdir`, coreutils). A model server is started so: CRIU's
dump of a PID namespace asks its init for a /proc of that namespace, and where the init's /proc is the host's (it
is, without a mount namespace of its own), criu's parasite mounts one on a folder it creates in the init's working
folder. A server's own folder may be read-only (a node's model roots are mounted read-only), so the init works in a
writable one; it also reaps what the server's processes leave behind and passes signals on to them.

Usage: python -m volga_agent.worker.nsinit [--no-pidns] [--keep] [--cpus LIST] [--init INIT DIR] LOGFILE -- COMMAND...
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

CLONE_NEWPID = 0x20000000
PR_SET_PDEATHSIG = 1
PR_GET_PDEATHSIG = 2
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
WAKE_SIGNAL = signal.SIGUSR1

_libc = ctypes.CDLL(None, use_errno=True)


def become_subreaper() -> None:
    """Orphaned descendants (launched or restored workers) are re-parented to this process."""
    if _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(err)}")


def host_ppid() -> int:
    """The parent's PID as the host sees it (getppid() is 0 for the init of a PID namespace; /proc is the host's)."""
    with open("/proc/self/stat") as stat:
        return int(stat.read().rsplit(") ", 1)[1].split()[1])


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(") ", 1)[1][0] not in "ZX"
    except (OSError, IndexError):
        return False


def parent_death_signal() -> int:
    value = ctypes.c_int(0)
    _libc.prctl(PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0)
    return value.value


def die_with(parent: int) -> bool:
    """Be SIGKILLed when `parent`, our parent now, dies. A parent that died already (we were handed to another
    reaper) ends this process at once; one that lives but is not our parent (not a subreaper) leaves the
    signal unarmed: False."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if host_ppid() == parent:
        return True
    _libc.prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0)
    if not _running(parent):
        os._exit(1)
    return False


def no_new_privileges() -> None:
    """No exec of a set-user-ID or file-capability program gives this process (or its children) more rights."""
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(err)}")


def release_parent() -> bool:
    """Disarm the parent-death signal before a checkpoint; whether it was armed."""
    armed = parent_death_signal() != 0
    _libc.prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0)
    return armed


def under_init(init: str, command: list[str]) -> list[str]:
    """`command` as the child of `init` (tini: -g passes signals on to the command's whole process group), in the
    folder it is started from, whatever folder the init works in."""
    return [init, "-g", "--", "/usr/bin/env", f"--chdir={os.getcwd()}", *command]


def main(argv: list[str]) -> int:
    pidns = True
    keep = False
    cpus: set[int] = set()
    init: tuple[str, str] | None = None
    while argv[:1] in (["--no-pidns"], ["--cpus"], ["--keep"], ["--init"]):
        if argv[0] == "--no-pidns":
            pidns, argv = False, argv[1:]
        elif argv[0] == "--keep":
            keep, argv = True, argv[1:]
        elif argv[0] == "--init":  # too few arguments leave none: the usage below
            init, argv = (argv[1], argv[2]) if len(argv) > 2 else ("", ""), argv[3:]
        else:
            cpus, argv = {int(c) for c in argv[1].split(",") if c}, argv[2:]
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m volga_agent.worker.nsinit [--no-pidns] [--keep] [--cpus LIST] [--init INIT DIR] "
              "LOGFILE -- COMMAND...", file=sys.stderr)
        return 2
    logfile, command = argv[0], argv[2:]
    if init is not None:
        command = under_init(init[0], command)
    if pidns and _libc.unshare(CLONE_NEWPID) != 0:
        err = ctypes.get_errno()
        print(f"unshare(CLONE_NEWPID): {os.strerror(err)} (needs CAP_SYS_ADMIN)", file=sys.stderr)
        return 1
    launcher, agent = os.getpid(), os.getppid()
    pid = os.fork()
    if pid == 0:
        if not keep:
            while host_ppid() == launcher:  # the launcher exits as soon as it has printed our PID
                time.sleep(0.0005)
            die_with(agent)
        os.setsid()
        signal.pthread_sigmask(signal.SIG_BLOCK, [WAKE_SIGNAL])
        if cpus:
            os.sched_setaffinity(0, cpus)
        log = os.open(logfile, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.closerange(3, 1 << 16)
        try:
            if init is not None:
                os.chdir(init[1])
            os.execvp(command[0], command)
        finally:
            os._exit(127)
    print(pid, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
