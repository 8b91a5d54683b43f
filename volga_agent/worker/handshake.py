"""What a model server Volga runs can do for its freezes (`ServerSpec.hooks`), in two lines each.

The checkpoint handshake (`hooks.signalFiles`):

    from volga_agent.worker import handshake
    handshake.checkpoint_here()   # once the engine is loaded, before the server opens its sockets

Under Volga ($VOLGA_SIGNAL_DIR set) this writes `ready-for-checkpoint` into that folder and waits until
`restore-complete` appears: Volga takes the server's image meanwhile, and every wake restores it and writes the
file, so the call returns in each restored copy (and once in the process that was started). Elsewhere it returns
at once.

The driver's copy kept out of the image, for a GPU server's FROZEN tier:

    handshake.park_driver_copy_when_asked()   # at start, in each process that holds a CUDA context

or, for a server left as it is, its command run through this module (`python -m volga_agent.worker.handshake -m
uvicorn app:app ...`, or a script's path in place of `-m module`). The CUDA driver's checkpoint copies a process's
device memory into its host memory, which a CRIU image would carry page by page and an eager restore would read
back at the page-fault rate. A thread of the process waits for Volga to name the pages the checkpoint filled, copies
them into a file beside the images and maps that file over them (`worker.regions.move`, as Volga's own worker does),
so that the image records them by path: smaller, and restorable lazily (docs/servers.md, "The driver's copy
parked"). The pages are named once the driver has checkpointed the process, while the server idles (Volga freezes a
server with no request in flight); a process that allocated and wrote fresh memory meanwhile could lose such a write
while it is moved, which the canary after the wake would tell.

The same thread lowers the per-thread stack its CUDA contexts reserve when Volga asks, before each driver
checkpoint (`trim_cuda_stack`): a context keeps that much local memory for every thread the GPU can run at once
(about 264 MiB per KiB on an H200), and the driver's checkpoint copies it out and its restore copies it back.

Only the standard library at import: the server's process imports it, and it is what gets frozen.
"""

from __future__ import annotations

import json
import os
import pathlib
import runpy
import sys
import threading
import time
import types

SIGNAL_DIR_ENV = "VOLGA_SIGNAL_DIR"
READY = "ready-for-checkpoint"
RESTORED = "restore-complete"
# Per process (the suffix is its PID as the process sees it): it parks the driver's copy when asked; the request
# (JSON {"regions": [[start, end, prot], ...], "file": path}); the answer (`regions.move_as_named`'s: JSON
# {"bytes": n, "regions": n, "seconds": s}, or {"error": why}).
PARKS = "parks"
PARK = "park-driver-copy"
PARKED = "driver-copy-parked"
# Per process as well: lower its CUDA contexts' per-thread stack (JSON {"bytes": n}); the answer
# (`trim_cuda_stack`'s: JSON {"contexts": n, "before": [bytes, ...]}, or {"error": why}).
TRIM = "trim-cuda-stack"
TRIMMED = "cuda-stack-trimmed"
CU_LIMIT_STACK_SIZE = 0


def checkpoint_here(poll_sec: float = 0.001) -> bool:
    """Offer this point to Volga for its image and wait until it says go on; False when not run by Volga."""
    folder = os.environ.get(SIGNAL_DIR_ENV)
    if not folder:
        return False
    signals = pathlib.Path(folder)
    (signals / RESTORED).unlink(missing_ok=True)
    _publish(signals / READY, str(os.getpid()))
    done = signals / RESTORED
    while not done.exists():
        time.sleep(poll_sec)
    return True


_parking: set[int] = set()  # the processes (by PID: a forked child has none) whose thread runs
_parking_lock = threading.Lock()


def park_driver_copy_when_asked(poll_sec: float = 0.005) -> bool:
    """Start the thread that moves the driver's copy of this process when Volga asks (once: a second call finds it
    running); False when not run by Volga."""
    folder = os.environ.get(SIGNAL_DIR_ENV)
    if not folder:
        return False
    from volga_agent.worker import regions  # numpy: loaded now, not while a freeze waits

    signals, pid = pathlib.Path(folder), os.getpid()
    with _parking_lock:
        if pid in _parking:
            return True
        _parking.add(pid)
    threading.Thread(target=_park_when_asked, args=(signals, pid, poll_sec, regions), name="volga-park",
                     daemon=True).start()
    _publish(signals / f"{PARKS}.{pid}", "")
    return True


def _park_when_asked(signals: pathlib.Path, pid: int, poll_sec: float, regions: types.ModuleType) -> None:
    asked, trim = signals / f"{PARK}.{pid}", signals / f"{TRIM}.{pid}"
    while True:
        if trim.exists():
            try:
                report = trim_cuda_stack(int(json.loads(trim.read_text())["bytes"]))
            except (OSError, ValueError, KeyError, TypeError) as exc:  # told to Volga: the stack stays as it is
                report = {"error": f"{type(exc).__name__}: {exc}"}
            trim.unlink(missing_ok=True)
            _publish(signals / f"{TRIMMED}.{pid}", json.dumps(report))
        if asked.exists():
            try:
                request = asked.read_text()
                report = regions.move_as_named(request, json.loads(request)["file"])
            except (OSError, ValueError, KeyError, TypeError) as exc:  # told to Volga: the copy stays in the image
                report = {"error": f"{type(exc).__name__}: {exc}"}
            asked.unlink(missing_ok=True)
            _publish(signals / f"{PARKED}.{pid}", json.dumps(report))
        time.sleep(poll_sec)


def trim_cuda_stack(nbytes: int) -> dict[str, object]:
    """Set CU_LIMIT_STACK_SIZE of every primary CUDA context this process holds (those a framework's runtime uses)
    to `nbytes`; no context is made where there is none. The driver grows the stack again for any kernel that needs
    more when it is launched. Returns {"contexts": how many, "before": each one's stack size before}; OSError where
    the driver cannot be loaded or a call fails (the call and its CUresult named)."""
    import ctypes

    if nbytes <= 0:
        raise ValueError(f"a CUDA stack of {nbytes} bytes")
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise OSError(f"the CUDA driver cannot be loaded: {exc}") from exc

    def call(name: str, *args: object) -> None:
        code = getattr(cuda, name)(*args)
        if code != 0:
            raise OSError(f"{name} failed (CUresult {code})")

    count, before = ctypes.c_int(), []
    call("cuInit", 0)  # done already where a context exists
    call("cuDeviceGetCount", ctypes.byref(count))
    for ordinal in range(count.value):
        device, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        call("cuDeviceGet", ctypes.byref(device), ordinal)
        call("cuDevicePrimaryCtxGetState", device, ctypes.byref(flags), ctypes.byref(active))
        if not active.value:
            continue
        context, size = ctypes.c_void_p(), ctypes.c_size_t()
        call("cuDevicePrimaryCtxRetain", ctypes.byref(context), device)
        try:
            call("cuCtxPushCurrent_v2", context)
            try:
                call("cuCtxGetLimit", ctypes.byref(size), CU_LIMIT_STACK_SIZE)
                call("cuCtxSetLimit", CU_LIMIT_STACK_SIZE, ctypes.c_size_t(nbytes))
            finally:
                cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        finally:
            cuda.cuDevicePrimaryCtxRelease_v2(device)
        before.append(size.value)
    return {"contexts": len(before), "before": before}


def _publish(path: pathlib.Path, text: str) -> None:
    """Write a signal file whole: a temporary file, then a rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.rename(path)


def main(argv: list[str] | None = None) -> None:
    """`python -m volga_agent.worker.handshake [-m module | script] [args...]`: run a Python server as `python`
    would, its driver's copy parked when Volga asks."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or (args[0] == "-m" and len(args) < 2):
        sys.exit("usage: python -m volga_agent.worker.handshake (-m module | script.py) [arguments...]")
    park_driver_copy_when_asked()
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        sys.path.insert(0, str(pathlib.Path(args[0]).resolve().parent))
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    from volga_agent.worker import handshake  # the thread runs in the module of that name, not in __main__

    handshake.main()
