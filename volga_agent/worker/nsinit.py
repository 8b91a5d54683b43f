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

With `--cpus 0,1,...` the child is pinned to those CPUs before it executes the command, so every thread
the worker starts (numpy's and the framework's included, some of which start at import) inherits the mask:
numaAffinity keeps a worker on the NUMA node of its GPU.

Usage: python -m volga_agent.worker.nsinit [--no-pidns] [--cpus LIST] LOGFILE -- COMMAND...
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

CLONE_NEWPID = 0x20000000
PR_SET_CHILD_SUBREAPER = 36
WAKE_SIGNAL = signal.SIGUSR1

_libc = ctypes.CDLL(None, use_errno=True)


def become_subreaper() -> None:
    """Orphaned descendants (launched or restored workers) are re-parented to this process."""
    if _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(err)}")


def main(argv: list[str]) -> int:
    pidns = True
    cpus: set[int] = set()
    while argv[:1] in (["--no-pidns"], ["--cpus"]):
        if argv[0] == "--no-pidns":
            pidns, argv = False, argv[1:]
        else:
            cpus, argv = {int(c) for c in argv[1].split(",") if c}, argv[2:]
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m volga_agent.worker.nsinit [--no-pidns] [--cpus LIST] LOGFILE -- COMMAND...",
              file=sys.stderr)
        return 2
    logfile, command = argv[0], argv[2:]
    if pidns and _libc.unshare(CLONE_NEWPID) != 0:
        err = ctypes.get_errno()
        print(f"unshare(CLONE_NEWPID): {os.strerror(err)} (needs CAP_SYS_ADMIN)", file=sys.stderr)
        return 1
    pid = os.fork()
    if pid == 0:
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
            os.execvp(command[0], command)
        finally:
            os._exit(127)
    print(pid, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
