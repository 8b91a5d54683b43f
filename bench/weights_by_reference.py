"""Experiment: keep a GPU process's weights out of its CRIU image by parking them in a shared file mapping.

A FROZEN GPU worker today goes HOT -> driver checkpoint (device memory copied into the process's anonymous
host memory) -> CRIU dump (that memory written into the image); a wake reads it all back at the machine's
single-thread page-fault rate (~1.3 GB/s on the H200 VM), then the driver copies it to the GPU. With
`--park file`, the process first copies its weights into a MAP_SHARED mapping of a file on /dev/shm and frees
them on the GPU: the driver then has only the context to save, CRIU records the file mapping by reference
(not its pages), and after the restore the process copies the weights back to the GPU from that mapping.

One bare PyTorch process per case (no Volga worker), so the mechanism is measured alone:
    python3 bench/weights_by_reference.py --gib 0.1,2 [--out FILE.json]
prints, per size and mode (anon = today's path, file = parked): image size, dump and restore times, the
driver restore, the weight reload, time to the first answer, and whether the answer is bit-identical.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

CHILD = r'''
import mmap, os, pathlib, signal, sys, time, json
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
import torch
gib, park, folder = float(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
rows = max(4096, int(gib * 2**30 / 4 / 4096))
torch.manual_seed(0)
w = torch.randn(rows, 4096, device="cuda") * 0.01
x = torch.randn(64, 4096, device="cuda")
def answer(weights):
    return (x @ weights[:4096].T).float().cpu().numpy().tobytes() + weights.sum(dim=0).cpu().numpy().tobytes()
ref = answer(w)
torch.cuda.synchronize()
if park == "file":
    path = folder / "weights.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, w.numel() * 4)
    mapping = mmap.mmap(fd, w.numel() * 4, mmap.MAP_SHARED)
    os.close(fd)
    host = torch.frombuffer(mapping, dtype=torch.float32).view(rows, 4096)
    host.copy_(w)
    del w
    torch.cuda.empty_cache()
(folder / "ready").write_text(str(os.getpid()))
while not (folder / "go").exists():
    signal.sigtimedwait([signal.SIGUSR1], 0.05)
t0 = time.perf_counter()
if park == "file":
    w = host.to("cuda", non_blocking=False)
    torch.cuda.synchronize()
reload_s = time.perf_counter() - t0
same = answer(w) == ref
(folder / "result.json").write_text(json.dumps({"same": same, "reload_s": reload_s}))
while True:
    time.sleep(1)
'''


def run_case(gib: float, park: str, root: pathlib.Path) -> dict[str, object]:
    from volga_agent.snapshot import criu, cuda
    from volga_agent.worker import nsinit

    folder = pathlib.Path(tempfile.mkdtemp(prefix=f"wbr-{park}-", dir="/dev/shm"))
    script = folder / "child.py"
    script.write_text(CHILD)
    nsinit.become_subreaper()
    out = subprocess.run([sys.executable, "-m", "volga_agent.worker.nsinit", "--no-pidns", str(folder / "log"), "--",
                          sys.executable, str(script), str(gib), park, str(folder)],
                         capture_output=True, text=True, check=True)
    pid = int(out.stdout)
    deadline = time.monotonic() + 120
    while not (folder / "ready").exists():
        if time.monotonic() > deadline:
            raise RuntimeError((folder / "log").read_text()[-2000:])
        time.sleep(0.01)
    driver = cuda.DriverCheckpoint()
    engine = criu.CriuEngine(root)
    t0 = time.perf_counter()
    driver.suspend(pid)
    suspend_s = time.perf_counter() - t0
    image = engine.dump(pid, f"{park}-{gib}")
    os.waitpid(pid, 0)
    t0 = time.perf_counter()
    restored = engine.restore(image)
    restore_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    driver.resume(restored.pid)
    driver_s = time.perf_counter() - t1
    (folder / "go").write_text("1")
    os.kill(restored.pid, signal.SIGUSR1)
    while not (folder / "result.json").exists():
        if time.perf_counter() - t0 > 120:
            raise RuntimeError((folder / "log").read_text()[-2000:])
        time.sleep(0.001)
    total_s = time.perf_counter() - t0
    result = json.loads((folder / "result.json").read_text())
    os.kill(restored.pid, signal.SIGKILL)
    os.waitpid(restored.pid, 0)
    engine.remove(image)
    size = image.size_bytes
    for f in folder.iterdir():
        f.unlink()
    folder.rmdir()
    return {"gib": gib, "park": park, "image_mib": round(size / 2**20, 1), "suspend_ms": round(suspend_s * 1e3, 1),
            "dump_ms": round(image.dump_seconds * 1e3, 1), "criu_restore_ms": round(restore_s * 1e3, 1),
            "driver_restore_ms": round(driver_s * 1e3, 1), "reload_ms": round(result["reload_s"] * 1e3, 1),
            "first_answer_ms": round(total_s * 1e3, 1), "answer_identical": result["same"]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", default="0.1,2")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    root = pathlib.Path(tempfile.mkdtemp(prefix="wbr-img-", dir="/dev/shm"))
    rows = []
    for gib in (float(g) for g in args.gib.split(",")):
        for _ in range(args.repeat):
            for park in ("anon", "file"):
                try:
                    rows.append(run_case(gib, park, root))
                except Exception as exc:  # report and go on: this is an experiment
                    rows.append({"gib": gib, "park": park, "error": f"{type(exc).__name__}: {exc}"[:1500]})
                print(json.dumps(rows[-1]), flush=True)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
