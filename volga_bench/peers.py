"""`volga bench peers`: Volga's gateway side by side with KServe's ModelServer: the same model, the same client.

Volga's other benches compare it with its own tiers; users compare it with what they run today. KServe's Python
ModelServer (Open Inference Protocol v2 over REST and gRPC) is the closest peer that runs on one machine. This
bench runs, one after the other, in one run:

- KServe: `kserve_onnx.py` (a small `kserve.Model` serving the ONNX model with onnxruntime under the same session
  settings as Volga's worker), started `cold_starts` times; each time from process start to the first correct
  answer (before any pod scheduling or image pull a cluster adds), the last one then serves the steady state;
- Volga: `volga up` with the default model (as a user runs it, a separate process): the steady state, then
  FROZEN wakes to the first answer (the instance goes back to FROZEN after `--idle-sec` between wakes);
- Volga with dynamic batching in the gateway (`spec.runtime.dynamicBatching`): the same steady state.

The steady state is the same for both: an unmodified tritonclient over gRPC at batch 1; HOT p50/p99 with one
client sending `requests` requests back to back, then the throughput of 8 and 32 clients (threads, each its own
client, closed loop) for `seconds` each, with the CPU time per answer of each server's processes over that window
(`concN_cpu_us`: Volga's `volga up` process, agent and gateway, apart from its worker; KServe's server; and this
process, the clients, for both). Every answer is compared with onnxruntime run directly in this process on the
same inputs. The model alone in-process (no server) is measured too, as the floor both stand on.

KServe comes from the `peers` extra (the current release, installed beside Volga and tritonclient) or from any
interpreter given with `kserve_python` (a separate virtual environment with another KServe release): the server is
that interpreter running `kserve_onnx.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import onnxruntime as ort
import tritonclient.grpc as grpcclient
import yaml

from volga_agent.app import defaultmodel
from volga_agent.host import process
from volga_agent.node import instance
from volga_agent.rpc.volga.v1 import agent_pb2, agent_pb2_grpc
from volga_agent.worker import contract
from volga_bench import harness, reporting
from volga_core import api

OUTPUT = "probability"
# Run as a script by the interpreter that has KServe (it may be another virtual environment's).
KSERVE_SERVER = pathlib.Path(__file__).with_name("kserve_onnx.py")


@dataclasses.dataclass(frozen=True)
class Settings:
    requests: int = 2000  # HOT, one client, back to back
    warmup: int = 200  # requests before any timing, per server
    seconds: float = 6.0  # per concurrency level
    concurrency: tuple[int, ...] = (8, 32)
    cold_starts: int = 3  # KServe process starts
    wakes: int = 5  # Volga FROZEN wakes
    idle_sec: float = 2.0  # `volga up --idle-sec`: how soon an idle instance goes back to FROZEN
    kserve_python: str = ""  # the interpreter that runs KServe; "" finds one (`find_kserve`)
    batched: bool = True  # also Volga with dynamic batching in the gateway (`run_volga_steady`)
    # Both servers load the default model with its weights beside it (ONNX external data) rather than inside it:
    # Volga's workers then map them, and its FROZEN images leave them out.
    external_data: bool = False
    # Where the servers (KServe's; `volga up` with its workers) and this process (the clients, the model alone)
    # run; () leaves them on every CPU. On a machine with more cores than the servers get, clients on other CPUs
    # leave the servers' CPUs to the servers, as in a cluster, where the clients are elsewhere.
    server_cpus: tuple[int, ...] = ()
    client_cpus: tuple[int, ...] = ()
    gateway_processes: int = 1  # `volga up --gateway-processes`: Volga's gateway processes on its ports
    hot_instances: int = 1  # above 1: also Volga with this many HOT instances of the model (pool.hot)


# Each client thread of a throughput run on a TCP connection of its own, as separate clients are (channels with
# the same arguments would otherwise share one connection through gRPC's global subchannel pool).
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


class KServeMissing(RuntimeError):
    """No interpreter with KServe to run the peer with."""


def find_kserve(given: str = "") -> str:
    """The interpreter that runs KServe: `given`, else $VOLGA_KSERVE_PYTHON, else this one when it has kserve."""
    for candidate in (given, os.environ.get("VOLGA_KSERVE_PYTHON", "")):
        if candidate:
            if shutil.which(candidate) is None:
                raise KServeMissing(f"--kserve-python {candidate}: no such interpreter")
            return candidate
    if _has_kserve(sys.executable):
        return sys.executable
    raise KServeMissing("KServe is not installed here: pip install 'volga[peers]', or give --kserve-python (or "
                        "VOLGA_KSERVE_PYTHON) an interpreter that has kserve and onnxruntime")


def _has_kserve(python: str) -> bool:
    import importlib.util

    return python == sys.executable and importlib.util.find_spec("kserve") is not None


def versions(python: str) -> dict[str, str]:
    """kserve, onnxruntime, grpcio and protobuf as installed for `python`."""
    code = ("import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in "
            "('kserve', 'onnxruntime', 'grpcio', 'protobuf')}))")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    if out.returncode != 0:
        raise KServeMissing(f"{python} cannot report its KServe version: {out.stderr.strip()[-300:]}")
    import json

    return dict(json.loads(out.stdout))


# -- the client side, the same for both -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
    model: str
    decls: tuple[contract.TensorDecl, ...]
    arrays: dict[str, np.ndarray]
    reference: np.ndarray  # onnxruntime run directly on `arrays`

    def inputs(self) -> list[Any]:
        return harness.triton_inputs(self.decls, self.arrays)


@dataclasses.dataclass
class Checker:
    """Counts answers that differ from the reference (onnxruntime run directly) and requests that failed."""

    reference: np.ndarray
    mismatches: int = 0
    errors: int = 0
    max_abs_diff: float = 0.0
    first_error: str = ""
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def answer(self, result: Any) -> None:
        out = result.as_numpy(OUTPUT)
        same = out is not None and out.shape == self.reference.shape
        diff = float(np.max(np.abs(out - self.reference))) if same else float("inf")
        with self.lock:
            self.max_abs_diff = max(self.max_abs_diff, diff)
            # The same onnxruntime and settings give the same bits; another onnxruntime (a peer's own virtual
            # environment) may round differently in the last place.
            self.mismatches += int(not (same and np.allclose(out, self.reference, rtol=1e-5, atol=1e-7)))

    def failed(self, exc: Exception) -> None:
        with self.lock:
            self.errors += 1
            self.first_error = self.first_error or f"{type(exc).__name__}: {exc}"[:300]

    def report(self) -> dict[str, Any]:
        return {"outputs_match": self.mismatches == 0 and self.errors == 0, "mismatches": self.mismatches,
                "errors": self.errors, "max_abs_diff": self.max_abs_diff,
                **({"first_error": self.first_error} if self.first_error else {})}


def hot(address: str, work: Workload, settings: Settings, check: Checker) -> dict[str, Any]:
    """One client, requests back to back: p50/p99 of each request as the client sees it."""
    client = grpcclient.InferenceServerClient(address)
    inputs = work.inputs()
    try:
        for _ in range(settings.warmup):
            check.answer(client.infer(work.model, inputs))
        latencies = []
        for _ in range(settings.requests):
            start = time.perf_counter()
            result = client.infer(work.model, inputs)
            latencies.append(time.perf_counter() - start)
            check.answer(result)
    finally:
        client.close()
    return reporting.summarize(latencies)


@dataclasses.dataclass(frozen=True)
class Watched:
    """The server's processes whose CPU time a throughput run divides by its answers, by role ("gateway",
    "worker", "server"); the bench's own process (the clients) is always counted, as "clients"."""

    roles: dict[str, tuple[int, ...]]

    def cpu_seconds(self) -> dict[str, float]:
        roles = {role: sum(map(process.cpu_seconds, pids)) for role, pids in self.roles.items()}
        return {"clients": time.process_time(), **roles}

    def cpus(self) -> dict[str, list[int]]:
        """The CPUs each role's processes may run on, read from the processes themselves."""
        def allowed(pids: tuple[int, ...]) -> list[int]:
            found: set[int] = set()
            for pid in pids:
                with contextlib.suppress(OSError):
                    found |= os.sched_getaffinity(pid)
            return sorted(found)

        return {"clients": sorted(os.sched_getaffinity(0)), **{r: allowed(p) for r, p in self.roles.items()}}


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (children, theirs, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit() and (up := process.parent(int(entry.name))) is not None:
            children.setdefault(up, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def throughput(address: str, work: Workload, clients: int, seconds: float, check: Checker,
               watched: Watched | None = None) -> tuple[float, dict[str, float]]:
    """`clients` threads, each with its own tritonclient and connection, closed loop for `seconds`: answers per
    second, and the CPU microseconds per answer that each of the `watched` processes spent from the window's start
    until the last client stopped."""
    window: list[float] = []  # when the timed window ends, set as the last thread reaches the barrier
    spent: list[dict[str, float]] = []

    def begin() -> None:
        spent.append(watched.cpu_seconds() if watched else {})
        window.append(time.perf_counter() + seconds)

    ready = threading.Barrier(clients + 1, action=begin)
    counts = [0] * clients

    def client_loop(i: int) -> None:
        client = grpcclient.InferenceServerClient(address, channel_args=OWN_CONNECTION)
        inputs = work.inputs()
        try:
            for _ in range(3):  # the channel and the server's first calls, outside the window
                client.infer(work.model, inputs)
            ready.wait()
            while time.perf_counter() < window[0]:
                try:
                    check.answer(client.infer(work.model, inputs))
                    counts[i] += 1
                except grpcclient.InferenceServerException as exc:
                    check.failed(exc)
        except Exception as exc:
            check.failed(exc)
            ready.abort()
        finally:
            client.close()

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    try:
        ready.wait(timeout=120)
    except threading.BrokenBarrierError:
        raise RuntimeError(f"the {clients} clients could not start: {check.first_error}") from None
    for t in threads:
        t.join()
    rps = round(sum(counts) / (time.perf_counter() - (window[0] - seconds)), 1)
    after = watched.cpu_seconds() if watched else {}
    return rps, {role: round((after[role] - before) / max(1, sum(counts)) * 1e6) for role, before in spent[0].items()}


def steady_state(address: str, work: Workload, settings: Settings, check: Checker,
                 progress: Callable[[str], None], watched: Watched | None = None) -> dict[str, Any]:
    """HOT latency with one client, then the throughput of each concurrency with the CPU time per answer of the
    `watched` processes (`concN_cpu_us`)."""
    progress(f"  HOT: one client, {settings.requests} requests")
    one = hot(address, work, settings, check)
    out: dict[str, Any] = {"hot_p50_ms": one["p50_ms"], "hot_p99_ms": one["p99_ms"], "hot": one}
    if watched is not None:
        out["cpus"] = watched.cpus()
        out["processes"] = {role: len(pids) for role, pids in watched.roles.items()}
    for clients in settings.concurrency:
        progress(f"  {clients} clients for {settings.seconds:g} s")
        rps, cpu = throughput(address, work, clients, settings.seconds, check, watched)
        out[f"conc{clients}_rps"] = rps
        out[f"conc{clients}_cpu_us"] = cpu
    return out


def _server(pid: int) -> Watched:
    """A server process with all it started: one role."""
    return Watched({"server": (pid, *descendants(pid))})


def _volga(pid: int, timeout: float = 10.0) -> Watched:
    """`volga up` (agent and gateway, one process) with its other gateway processes, and its HOT workers apart.

    A worker just restored with lazy pages shows an empty command line until the page holding it is in (the kernel
    reads it without waiting on the page server), so the workers are looked for until one shows."""
    deadline = time.monotonic() + timeout
    while True:
        below = descendants(pid)
        gateways = tuple(p for p in below if _runs(p, b"gateway_main"))
        workers = tuple(p for p in below if _runs(p, b"volga_agent.worker.serve"))
        if workers or time.monotonic() > deadline:
            return Watched({"gateway": (pid, *gateways), "worker": workers})
        time.sleep(0.05)


def _runs(pid: int, what: bytes) -> bool:
    try:
        return what in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def first_answer(address: str, work: Workload, started: float, alive: Callable[[], bool],
                 check: Checker, timeout: float = 180.0) -> float:
    """Seconds from `started` to the first correct answer at `address`, trying every few milliseconds.

    Each try uses a fresh client once the port accepts connections, so gRPC's reconnect backoff (a second and
    more) never stands between a server that is up and the answer.
    """
    host, _, port = address.rpartition(":")
    deadline = started + timeout
    while time.perf_counter() < deadline:
        if not alive():
            raise RuntimeError(f"the server at {address} exited before it answered")
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
        except OSError:
            time.sleep(0.002)
            continue
        client = grpcclient.InferenceServerClient(address)
        try:
            result = client.infer(work.model, work.inputs())
            elapsed = time.perf_counter() - started
            check.answer(result)
            return elapsed
        except grpcclient.InferenceServerException:
            time.sleep(0.002)
        finally:
            client.close()
    raise TimeoutError(f"no answer from {address} within {timeout:g} s")


# -- the servers -----------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def kserve_server(python: str, model_path: pathlib.Path, model: str, threads: int, log: pathlib.Path,
                  cpus: tuple[int, ...] = ()) -> Iterator[tuple[subprocess.Popen[bytes], str, float]]:
    """KServe's ModelServer on free ports (on `cpus` only, when given): (process, gRPC address, when it was
    started)."""
    grpc_port, http_port = _free_port(), _free_port()
    cmd = [python, str(KSERVE_SERVER), "--model_name", model, "--model_path", str(model_path),
           "--intra_op_threads", str(threads), "--http_port", str(http_port), "--grpc_port", str(grpc_port)]
    with log.open("ab") as out:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": ""})
    if cpus:
        os.sched_setaffinity(proc.pid, cpus)  # before it starts a thread, which inherits it
    try:
        yield proc, f"127.0.0.1:{grpc_port}", started
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_kserve(python: str, model_path: pathlib.Path, work: Workload, threads: int, settings: Settings,
               logdir: pathlib.Path, progress: Callable[[str], None]) -> dict[str, Any]:
    check = Checker(work.reference)
    colds: list[float] = []
    out: dict[str, Any] = {}
    log = logdir / "kserve.log"
    for i in range(max(1, settings.cold_starts)):
        progress(f"KServe: start {i + 1}/{settings.cold_starts}, process start -> first answer")
        with kserve_server(python, model_path, work.model, threads, log, settings.server_cpus) as \
                (proc, address, started):
            colds.append(first_answer(address, work, started, lambda: proc.poll() is None, check))
            if i == max(1, settings.cold_starts) - 1:
                out = steady_state(address, work, settings, check, progress, _server(proc.pid))
    cold = reporting.summarize(colds)
    return {**out, "cold_start_ms": cold["p50_ms"], "cold_start": cold, **check.report()}


def _instances(stub: agent_pb2_grpc.AgentStub, model: str) -> list[Any]:
    return list(stub.ListInstances(agent_pb2.ListInstancesRequest(model_id=model), timeout=10).instances)


def _tier(stub: agent_pb2_grpc.AgentStub, model: str) -> str:
    return ",".join(agent_pb2.Tier.Name(i.tier) for i in _instances(stub, model))


def _wait_tier(stub: agent_pb2_grpc.AgentStub, model: str, tier: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while (now := _tier(stub, model)) != tier:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{model} did not reach {tier} within {timeout:g} s (it is {now})")
        time.sleep(0.02)


def _gateways(settings: Settings) -> list[str]:
    return ["--gateway-processes", str(settings.gateway_processes)] if settings.gateway_processes > 1 else []


def run_volga(work: Workload, settings: Settings, progress: Callable[[str], None],
              spec_file: pathlib.Path | None = None) -> dict[str, Any]:
    """`volga up` serving the default model (or `spec_file`'s): its FROZEN wakes, then its steady state."""
    check = Checker(work.reference)
    progress("Volga: starting volga up (default model; cold start, then freeze) ...")
    serve = ["-f", str(spec_file)] if spec_file is not None else []
    with harness.volga_up([*serve, "--idle-sec", f"{settings.idle_sec:g}", *_gateways(settings)],
                          cpus=settings.server_cpus) as up, \
            grpc.insecure_channel(up.endpoints["agent"]) as channel:
        stub = agent_pb2_grpc.AgentStub(channel)
        address = up.endpoints["grpc"]
        client = grpcclient.InferenceServerClient(address)
        inputs = work.inputs()
        wakes: list[float] = []
        agent_wakes: list[float] = []  # the agent's own restore + canary check, inside each wake
        out: dict[str, Any] = {}
        try:
            for i in range(max(1, settings.wakes)):
                _wait_tier(stub, work.model, api.Tier.FROZEN.value)
                progress(f"Volga: FROZEN wake {i + 1}/{settings.wakes} -> first answer")
                start = time.perf_counter()
                result = client.infer(work.model, inputs)
                wakes.append(time.perf_counter() - start)
                check.answer(result)
                agent_wakes.append(max(i.last_wake_ms for i in _instances(stub, work.model)) / 1e3)
                if i == 0:
                    # The steady state right after the first wake, before the instance idles back to FROZEN.
                    out = steady_state(address, work, settings, check, progress, _volga(up.proc.pid))
        finally:
            client.close()
    wake = reporting.summarize(wakes)
    return {**out, "frozen_wake_ms": wake["p50_ms"], "frozen_wake": wake,
            "frozen_wake_in_agent": reporting.summarize(agent_wakes), **check.report()}


# -- dynamic batching, several HOT instances ------------------------------------------------------------------


def run_volga_steady(work: Workload, settings: Settings, folder: pathlib.Path, progress: Callable[[str], None],
                     batched: bool = False, hot: int = 1) -> dict[str, Any]:
    """The same steady state against `volga up` serving the default model HOT, with dynamic batching in the gateway
    (`spec.runtime.dynamicBatching`, no added queue delay) or with `hot` HOT instances (pool.hot), over whose
    workers the gateway spreads requests. KServe has no batcher in its ModelServer (it batches through a separate
    agent container), and its gRPC server is one process, so neither has a counterpart here."""
    doc: dict[str, Any] = defaultmodel.spec_document(pathlib.Path(defaultmodel.ensure().spec.source_path))
    doc["spec"]["pool"] = {"hot": hot, "frozen": 0}
    if batched:
        doc["spec"]["runtime"]["dynamicBatching"] = {"enabled": True, "maxQueueDelayMicroseconds": 0,
                                                     "maxQueueSize": 4096}
    api.parse_model_spec(doc)
    path = folder / f"steady-{'batched' if batched else 'hot'}-{hot}.yaml"
    path.write_text(yaml.safe_dump(doc))
    check = Checker(work.reference)
    progress(f"Volga, {'dynamic batching' if batched else f'{hot} HOT instances'}: starting volga up -f ...")
    with harness.volga_up(["-f", str(path), *_gateways(settings)], cpus=settings.server_cpus) as up, \
            grpc.insecure_channel(up.endpoints["agent"]) as channel:
        _wait_tier(agent_pb2_grpc.AgentStub(channel), work.model, ",".join([api.Tier.HOT.value] * hot))
        out = steady_state(up.endpoints["grpc"], work, settings, check, progress, _volga(up.proc.pid))
    return {**out, **check.report()}


# -- the run ---------------------------------------------------------------------------------------------------


def model_alone(model_path: pathlib.Path, arrays: dict[str, np.ndarray], threads: int, n: int
                ) -> tuple[np.ndarray, dict[str, Any]]:
    """onnxruntime run directly in this process (the reference answer) and its latency: the floor under both."""
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    reference = session.run([OUTPUT], arrays)[0]
    for _ in range(50):
        session.run([OUTPUT], arrays)
    latencies = []
    for _ in range(n):
        start = time.perf_counter()
        session.run([OUTPUT], arrays)
        latencies.append(time.perf_counter() - start)
    return reference, reporting.summarize(latencies)


def run(settings: Settings | None = None, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    settings = settings or Settings()
    if settings.client_cpus:
        os.sched_setaffinity(0, settings.client_cpus)  # the client threads, started later, inherit it
    python = find_kserve(settings.kserve_python)
    peer_versions = versions(python)
    spec = defaultmodel.ensure().spec
    model_path = pathlib.Path(spec.source.removeprefix("file://"))
    spec_file = None
    if settings.external_data:
        folder = defaultmodel.default_cache() / f"{spec.model_id}-external"
        model_path = defaultmodel.build_onnx(folder / "model.onnx", external_data=True)
        spec_file = folder / "modelspec.yaml"
        spec_file.write_text(yaml.safe_dump(defaultmodel.spec_document(model_path)))
    threads = spec.runtime.intra_op_threads or 0
    decls = instance.decls(spec.inputs)
    arrays = contract.sample_inputs(decls, batch=1, seed=9)
    reference, alone = model_alone(model_path, arrays, threads, settings.requests)
    work = Workload(spec.model_id, decls, arrays, reference)
    load_start = os.getloadavg()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="volga-peers-") as logdir:
        kserve = run_kserve(python, model_path, work, threads, settings, pathlib.Path(logdir), progress)
        volga = run_volga(work, settings, progress, spec_file)
        batched = (run_volga_steady(work, settings, pathlib.Path(logdir), progress, batched=True)
                   if settings.batched else None)
        replicas = (run_volga_steady(work, settings, pathlib.Path(logdir), progress, hot=settings.hot_instances)
                    if settings.hot_instances > 1 else None)
    load_end = os.getloadavg()
    first = settings.concurrency[0] if settings.concurrency else None
    return {
        "volga": volga,
        "kserve": kserve,
        **({"volga_batched": batched} if batched else {}),
        **({"volga_hot_instances": replicas} if replicas else {}),
        "model_alone": alone,
        "volga_vs_kserve": {
            "hot_p50_ratio": round(volga["hot_p50_ms"] / kserve["hot_p50_ms"], 3),
            **({f"conc{first}_ratio": round(volga[f"conc{first}_rps"] / kserve[f"conc{first}_rps"], 2)}
               if first else {}),
            "wake_vs_cold_start": round(kserve["cold_start_ms"] / volga["frozen_wake_ms"], 1),
        },
        "model": spec.model_id,
        "model_weights": "external data" if settings.external_data else "embedded",
        "batch": 1,
        "intra_op_threads": threads,
        "client": f"tritonclient.grpc {_version('tritonclient')}",
        "kserve_versions": peer_versions,
        "volga_versions": {p: _version(p) for p in ("onnxruntime", "grpcio", "protobuf")},
        "device": reporting.device_description("cpu"),
        "settings": {**dataclasses.asdict(settings), "kserve_python": python},
        "load_avg_1m": [round(load_start[0], 2), round(load_end[0], 2)],
        "wall_s": round(time.perf_counter() - started, 1),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _version(package: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(package)


def format_report(report: dict[str, Any]) -> str:
    v, k = report["volga"], report["kserve"]
    conc = [key for key in v if key.startswith("conc") and key.endswith("_rps")]
    rows = [("HOT p50 ms (1 client)", "hot_p50_ms"), ("HOT p99 ms (1 client)", "hot_p99_ms"),
            *((f"{key[4:-4]} clients, requests/s", key) for key in conc)]
    # Volga's other steady states, a column each beside the two servers
    extra = [(title, report[key]) for title, key in (
        ("Volga batched", "volga_batched"), (f"Volga {report['settings'].get('hot_instances', 1)} HOT",
                                             "volga_hot_instances")) if key in report]
    lines = [f"{report['model']}, batch 1, {report['intra_op_threads']} intra-op thread(s); {report['device']}; "
             f"KServe {report['kserve_versions']['kserve']}; load average {report['load_avg_1m']}"
             + "".join(f"; {who} on CPUs {report['settings'][key]}" for who, key in
                       (("servers", "server_cpus"), ("clients", "client_cpus")) if report["settings"][key])
             + (f"; Volga with {report['settings']['gateway_processes']} gateway processes"
                if report["settings"].get("gateway_processes", 1) > 1 else ""),
             f"{'':<28}{'Volga':>12}{'KServe':>12}"]
    lines[-1] += "".join(f"{title:>16}" for title, _ in extra)
    lines += [f"{label:<28}{v[key]:>12.2f}{k[key]:>12.2f}" + "".join(f"{run[key]:>16.2f}" for _, run in extra)
              for label, key in rows]
    lines.append(f"{'first answer ms':<28}{v['frozen_wake_ms']:>12.1f}{k['cold_start_ms']:>12.1f}"
                 "   (Volga: FROZEN wake; KServe: process start)")
    for key in conc:
        vc, kc = v.get(f"{key[:-4]}_cpu_us"), k.get(f"{key[:-4]}_cpu_us")
        if vc and kc:
            lines.append(f"CPU us per answer, {key[4:-4]} clients: Volga gateway {vc['gateway']} + worker "
                         f"{vc['worker']}, KServe {kc['server']}; the clients {vc['clients']} / {kc['clients']}")
    lines.append(f"model alone in-process: p50 {report['model_alone']['p50_ms']:.3f} ms, "
                 f"p99 {report['model_alone']['p99_ms']:.3f} ms; outputs match onnxruntime: "
                 f"Volga {v['outputs_match']}, KServe {k['outputs_match']}")
    return "\n".join(lines)
