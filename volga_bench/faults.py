"""`volga bench faults`: what an operator's accidents do to `volga up`, one fault after another, under traffic.

It runs `volga up` with the default model as a separate process (as a user runs it) and keeps a steady stream of
tritonclient gRPC requests going, each checked against a direct onnxruntime run of the same inputs. It then
injects, one after another:

- corrupt pages: bytes flipped across the FROZEN image's pages file (the canary check must catch it);
- truncated pages: the pages file cut in half (criu restore hangs; its deadline must kill it);
- worker SIGKILL: the HOT worker killed under traffic;
- up SIGKILL during a wake, and during a dump: the agent killed while criu runs; `volga up` is started again
  and must leave nothing of the killed run (workers, criu, temporary images, work folders);
- full snapshot disk: the snapshot root on a size-limited tmpfs (`unshare -m`, in `volga up`'s own mount
  namespace), filled up before a freeze; the instance must keep serving and leave no partial image.

Per fault it reports the requests sent while the fault lasted, those answered correctly, wrongly, with an error,
those that hung (no answer within the client's timeout), the seconds from the injection to the first correct
answer, and what was leaked after it: processes (of killed runs, or criu calls not in flight) and images
(temporary images, killed runs' folders, more than one image per instance).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc as grpcclient

from volga_agent.app import defaultmodel
from volga_agent.host import process
from volga_agent.node import instance
from volga_agent.rpc.volga.v1 import agent_pb2, agent_pb2_grpc
from volga_agent.worker import contract
from volga_bench import harness, reporting

CLIENT_TIMEOUT_S = 120.0  # a request unanswered this long is a hang
# Every freeze dumps (no image reuse), so that a kill during a dump can be aimed at.
FRESH_DUMPS = ["--set", "snapshotIntervalSec=0.001"]
TIERS = {value: name for name, value in agent_pb2.Tier.items()}


def cmdline(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def running(pid: int) -> bool:
    """Alive and not a zombie (a killed process may wait as a zombie of a reaper that is not us)."""
    return not process.is_zombie(pid)


def token_of(pid: int) -> str:
    """The owner token a process gives the processes it starts (see `process.Owner`)."""
    start = process.start_time(pid)
    assert start is not None, f"pid {pid} is gone"
    return dataclasses.replace(process.me(), pid=pid, start=start).token


def carrying(token: str) -> list[int]:
    """Running processes whose environment holds this owner token."""
    marker = f"{process.OWNER_ENV}={token}".encode()
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if marker in (entry / "environ").read_bytes().split(b"\0") and running(int(entry.name)):
                    found.append(int(entry.name))
    return found


def workers(pid: int) -> list[int]:
    """The worker processes under `pid` (not the nsinit launcher that starts one, whose arguments name it too)."""
    return [child for child in process.tree(pid)[1:]
            if "volga_agent.worker.serve" in cmdline(child) and "nsinit" not in cmdline(child) and running(child)]


def wait_for_child(pid: int, words: tuple[str, ...], timeout: float, every: float = 0.002) -> int | None:
    """The first descendant of `pid` whose command line holds all `words` (polled), or None after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in process.tree(pid)[1:]:
            line = cmdline(child)
            if all(word in line for word in words):
                return child
        time.sleep(every)
    return None


class UpRun:
    """One `volga up` process on ephemeral ports, optionally inside a wrapper shell command (`prefix`, e.g. a
    mount namespace); its endpoints and folders as it announced them, and its owner token."""

    def __init__(self, extra: list[str] | None = None, prefix: str = "", timeout: float = 180.0) -> None:
        argv = [sys.executable, "-m", "volga_agent.cli", "up", "--http-port", "0", "--grpc-port", "0",
                "--metrics-port", "0", "--agent-port", "0", *(extra or [])]
        command: list[str] = ["sh", "-c", f"{prefix} && exec {shlex.join(argv)}"] if prefix else argv
        wrap = ["unshare", "-m"] if prefix else []
        self.proc = subprocess.Popen([*wrap, *command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.output: list[str] = []
        self.announced: dict[str, str] = {}
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while "models" not in self.announced:
            line = self.proc.stdout.readline()
            if not line or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("volga up did not start:\n" + "".join(self.output[-20:]))
            self.output.append(line)
            match = re.match(r"\s+(\w+)\s+(\S+)", line)
            if match:
                self.announced[match.group(1)] = match.group(2)
        threading.Thread(target=self._drain, daemon=True).start()
        self.pid = self.proc.pid
        self.token = token_of(self.pid)
        self.channel = grpc.insecure_channel(self.announced["agent"])
        self.agent: Any = agent_pb2_grpc.AgentStub(self.channel)  # type: ignore[no-untyped-call]

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)

    @property
    def grpc_address(self) -> str:
        return self.announced["grpc"]

    @property
    def folders(self) -> list[pathlib.Path]:
        return [pathlib.Path(self.announced[key]) for key in ("workdir", "snapshots")]

    @property
    def snapshots(self) -> pathlib.Path:
        return pathlib.Path(self.announced["snapshots"])

    def instance(self) -> Any:
        [inst] = self.agent.ListInstances(agent_pb2.ListInstancesRequest(), timeout=30).instances
        return inst

    def wait_tier(self, tier: str, timeout: float = 120.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            inst = self.instance()
            if TIERS[inst.tier] == f"TIER_{tier}" or TIERS[inst.tier] == tier:
                return inst
            time.sleep(0.05)
        raise TimeoutError(f"the instance did not reach {tier}; it is {TIERS[self.instance().tier]}")

    def release(self) -> None:
        """The instance counts as idle from now on: the next policy tick freezes it (unless that tick sees a
        request newer than the release, which counts as a use: `freeze` and `release_until_dump` release again)."""
        self.agent.Release(agent_pb2.ReleaseRequest(instance=self.instance().name), timeout=30)

    def freeze(self, timeout: float = 120.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            self.release()
            try:
                return self.wait_tier("FROZEN", 3.0)
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise

    def release_until_dump(self, timeout: float = 120.0) -> int | None:
        """Release until a criu dump of the instance runs; its PID (None after `timeout`)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.release()
            found = wait_for_child(self.pid, ("criu", "dump"), timeout=3.0)
            if found is not None:
                return found
        return None

    def image(self) -> pathlib.Path:
        """The instance's one published image folder."""
        inst = self.instance()
        images = [p for p in (self.snapshots / str(inst.name)).iterdir() if not p.name.startswith(".")]
        assert len(images) == 1, images
        return images[0]

    def restore_failures(self) -> float:
        """volga_snapshot_restore_failures, summed over its labels, from the metrics endpoint."""
        with urllib.request.urlopen(self.announced["metrics"], timeout=30) as reply:
            text = reply.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("volga_snapshot_restore_failures_total"))

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.channel.close()

    def stop(self) -> float:
        """SIGTERM; the seconds it took to exit."""
        start = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.channel.close()
        return time.monotonic() - start


@dataclasses.dataclass(frozen=True)
class Outcome:
    sent: float
    done: float
    result: str  # ok | wrong | error | hang
    max_abs_diff: float = 0.0


class Traffic:
    """Steady tritonclient gRPC requests (one in flight, at most `rate` per second), each answer compared with
    onnxruntime's own answer to the same inputs."""

    def __init__(self, rate: float = 20.0, inputs: int = 8, batch: int = 4) -> None:
        import onnxruntime

        spec = defaultmodel.ensure().spec
        self.model = spec.model_id
        self.decls = instance.decls(spec.inputs)
        self.inputs = [contract.sample_inputs(self.decls, batch=batch, seed=1000 + i) for i in range(inputs)]
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = spec.runtime.intra_op_threads or 1
        session = onnxruntime.InferenceSession(str(spec.source_path), options, providers=["CPUExecutionProvider"])
        self.references = [session.run(["probability"], x)[0] for x in self.inputs]
        self.interval = 1.0 / rate
        self.outcomes: list[Outcome] = []
        self.paused = threading.Event()
        self._stop = threading.Event()
        self._client: Any = None
        self._address = ""
        self._thread = threading.Thread(target=self._loop, name="traffic", daemon=True)

    def point(self, address: str) -> None:
        self._address = address

    def start(self, address: str) -> None:
        self.point(address)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=CLIENT_TIMEOUT_S + 10)

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        self.paused.set()
        time.sleep(2 * self.interval + 0.5)  # the request in flight finishes
        try:
            yield
        finally:
            self.paused.clear()

    def _loop(self) -> None:
        client_for = ""
        i = 0
        while not self._stop.is_set():
            if self.paused.is_set():
                time.sleep(0.01)
                continue
            if client_for != self._address:
                if self._client is not None:
                    self._client.close()
                self._client = grpcclient.InferenceServerClient(self._address)
                client_for = self._address
            k = i % len(self.inputs)
            i += 1
            sent = time.monotonic()
            self.outcomes.append(self._one(k, sent))
            time.sleep(max(0.0, self.interval - (time.monotonic() - sent)))
        if self._client is not None:
            self._client.close()

    def _one(self, k: int, sent: float) -> Outcome:
        try:
            result = self._client.infer(self.model, harness.triton_inputs(self.decls, self.inputs[k]),
                                        client_timeout=CLIENT_TIMEOUT_S)
            out = result.as_numpy("probability")
        except Exception as exc:  # every failure of a request is an outcome to count, not a crash of the bench
            hang = "Deadline" in str(exc) or "DEADLINE" in str(exc)
            return Outcome(sent, time.monotonic(), "hang" if hang else "error")
        same_shape = out.shape == self.references[k].shape
        diff = float(np.max(np.abs(out - self.references[k]))) if same_shape else float("inf")
        return Outcome(sent, time.monotonic(), "ok" if same_shape and diff == 0.0 else "wrong", diff)

    def window(self, start: float, end: float) -> dict[str, Any]:
        taken = [o for o in list(self.outcomes) if start <= o.sent < end]
        firsts = [o.done for o in taken if o.result == "ok"]
        return {"sent": len(taken), "correct": sum(o.result == "ok" for o in taken),
                "wrong": sum(o.result == "wrong" for o in taken), "errors": sum(o.result == "error" for o in taken),
                "hangs": sum(o.result == "hang" for o in taken),
                "recover_s": round(min(firsts) - start, 3) if firsts else None,
                "max_abs_diff": max((o.max_abs_diff for o in taken if o.result == "wrong"), default=0.0)}


def leaks(live: UpRun | None, killed: list[UpRun]) -> dict[str, Any]:
    """What is left that should not be: processes of killed runs, criu calls of the live run that are not in
    flight (checked while it idles HOT), temporary images, killed runs' folders, extra images per instance."""
    procs = [pid for run in killed for pid in carrying(run.token)]
    images = [str(p) for run in killed for p in run.folders if p.exists()]
    if live is not None:
        procs += [pid for pid in process.tree(live.pid)[1:] if "criu" in cmdline(pid)]
        for folder in (p for p in live.snapshots.iterdir() if p.is_dir() and p.name != "failed"):
            parts = [p for p in folder.iterdir() if p.is_dir()]
            images += [str(p) for p in parts if p.name.startswith(".tmp-")]
            published = [p for p in parts if not p.name.startswith(".")]
            images += [str(p) for p in published[1:]]
    return {"leaked_processes": len(procs), "leaked_images": len(images), "leaked": [*map(str, procs), *images]}


def flip_pages(image: pathlib.Path) -> None:
    """Flip one byte every 64 KiB across the pages files: the damage a bad disk or a stray write leaves."""
    for pages in image.glob("pages-*.img"):
        with pages.open("r+b") as f:
            size = pages.stat().st_size
            for offset in range(4096, size, 65536):
                f.seek(offset)
                byte = f.read(1)
                f.seek(offset)
                f.write(bytes([byte[0] ^ 0xFF]))


def _truncate_pages(image: pathlib.Path) -> None:
    for pages in image.glob("pages-*.img"):
        os.truncate(pages, pages.stat().st_size // 2)


def _settle(traffic: Traffic, seconds: float, until_ok_after: float, limit: float = 180.0) -> float:
    """Let traffic run until it has answered correctly after `until_ok_after` and then `seconds` more."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if any(o.result == "ok" and o.sent >= until_ok_after for o in list(traffic.outcomes)):
            break
        time.sleep(0.05)
    time.sleep(seconds)
    return time.monotonic()


def run(rate: float = 20.0, settle_s: float = 3.0, progress: Callable[[str], None] = lambda _: None
        ) -> dict[str, Any]:
    traffic = Traffic(rate)
    faults: dict[str, dict[str, Any]] = {}
    killed: list[UpRun] = []

    def record(name: str, start: float, up: UpRun, failures_before: float = 0.0, **extra: Any) -> None:
        end = _settle(traffic, settle_s, start)
        faults[name] = {**traffic.window(start, end), **leaks(up, killed),
                        "restore_failures": up.restore_failures() - failures_before, **extra}
        progress(f"{name}: {faults[name]}")

    progress("starting volga up (default model) ...")
    up = UpRun(FRESH_DUMPS)
    up.wait_tier("FROZEN")
    traffic.start(up.grpc_address)
    _settle(traffic, settle_s, time.monotonic())

    for name, damage in (("corrupt_pages", flip_pages), ("truncated_pages", _truncate_pages)):
        progress(f"{name}: freezing, damaging the image, then traffic again ...")
        with traffic.pause():
            up.freeze()
            damage(up.image())
            start, failures = time.monotonic(), up.restore_failures()
        record(name, start, up, failures)

    progress("worker_sigkill: killing the HOT worker under traffic ...")
    up.wait_tier("HOT")
    [worker] = workers(up.pid)
    start, failures = time.monotonic(), up.restore_failures()
    os.kill(worker, signal.SIGKILL)
    record("worker_sigkill", start, up, failures)

    for name, words in (("up_sigkill_in_wake", ("criu", "restore")), ("up_sigkill_in_dump", ("criu", "dump"))):
        progress(f"{name}: killing volga up while {words[1]} runs, then starting it again ...")
        with traffic.pause():
            if words[1] == "restore":
                up.freeze()
        if words[1] == "dump":
            traffic.paused.set()
            found = up.release_until_dump()
        else:
            found = wait_for_child(up.pid, words, timeout=120)
        start = time.monotonic()
        up.kill()
        killed.append(up)
        traffic.paused.clear()  # requests meet a dead gateway until the new one is up: errors, counted
        progress(f"{name}: killed while pid {found} ({words[1]}) ran; restarting ...")
        up = UpRun(FRESH_DUMPS)
        traffic.point(up.grpc_address)
        up.wait_tier("HOT")
        record(name, start, up, caught_in_the_act=found is not None)

    progress("full_snapshot_disk: volga up with its snapshots on a small tmpfs ...")
    traffic.paused.set()
    stop_s = up.stop()
    mount = pathlib.Path(tempfile.mkdtemp(prefix="vfd-", dir="/tmp"))
    try:
        up = UpRun(["--snapshot-dir", str(mount), *FRESH_DUMPS],
                   prefix=f"mount -t tmpfs -o size=256m volga-faults {shlex.quote(str(mount))}")
    except (RuntimeError, OSError) as exc:
        faults["full_snapshot_disk"] = {"skipped": f"no size-limited tmpfs here: {exc}"}
    else:
        up.wait_tier("FROZEN")
        traffic.point(up.grpc_address)
        traffic.paused.clear()
        up.wait_tier("HOT")
        filler = pathlib.Path(f"/proc/{up.pid}/root") / str(mount).lstrip("/") / "filler"
        with traffic.pause():
            with filler.open("wb") as f, contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 2**20)
            start = time.monotonic()
            deadline = start + 60
            while not up.instance().state_reason and time.monotonic() < deadline:
                up.release()  # until the policy has tried to freeze it, and said why it could not
                for _ in range(60):
                    if up.instance().state_reason:
                        break
                    time.sleep(0.05)
            reason = up.instance().state_reason
        record("full_snapshot_disk", start, up, freeze_refused=reason[:200])
        filler.unlink()
        with traffic.pause():
            up.freeze()
        faults["full_snapshot_disk"]["freezes_after_space_freed"] = True
        stop_s = up.stop()
    finally:
        shutil.rmtree(mount, ignore_errors=True)
    traffic.close()
    return {"model": traffic.model, "rate_rps": rate, "device": reporting.device_description("cpu"),
            "faults": faults, "sigterm_stop_s": round(stop_s, 3),
            "wrong_total": sum(f.get("wrong", 0) for f in faults.values()),
            "hangs_total": sum(f.get("hangs", 0) for f in faults.values()),
            "leaked_total": sum(f.get("leaked_processes", 0) + f.get("leaked_images", 0) for f in faults.values()),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def format_table(report: dict[str, Any]) -> str:
    header = (f"{'fault':<22}{'sent':>6}{'correct':>9}{'wrong':>7}{'errors':>8}{'hangs':>7}{'recover s':>11}"
              f"{'restore fails':>15}{'leaked procs':>14}{'leaked images':>15}")
    rows = [header]
    for name, f in report["faults"].items():
        if "skipped" in f:
            rows.append(f"{name:<22}skipped: {f['skipped']}")
            continue
        recover = "-" if f["recover_s"] is None else f"{f['recover_s']:.2f}"
        rows.append(f"{name:<22}{f['sent']:>6}{f['correct']:>9}{f['wrong']:>7}{f['errors']:>8}{f['hangs']:>7}"
                    f"{recover:>11}{f['restore_failures']:>15g}{f['leaked_processes']:>14}{f['leaked_images']:>15}")
    return "\n".join(rows)
