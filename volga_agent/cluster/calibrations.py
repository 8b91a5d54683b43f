"""Calibration on request: the calibrations a ModelSpec asks for (`labels.ANNOTATION_CALIBRATE`) that this node
answers (`Calibrations`, with the measurement passed in as a `Calibrator`), and the baselines measured so far that
hold for a ModelSpec's current version (`measured_baselines`, from its status.calibrated).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import kubernetes
import pydantic

from volga_agent.host import gpus
from volga_core import api
from volga_core.api import conditions, labels
from volga_core.kube import client as kube_client
from volga_core.kube import ratelimit

log = logging.getLogger(__name__)

LEASE_SEC = 60
CALIBRATED = "Calibrated"  # the condition type of a status.calibratedFor entry


class Calibrator(Protocol):
    """Measures a ModelSpec's baselines on this node with a worker of its own (`volga calibrate`'s measurement,
    passed in by the daemons): blocking; raises `CalibrationFailed` with the reason, or any error."""

    def __call__(self, spec: api.ModelSpecSpec, device: str, /) -> api.Calibration: ...


class CalibrationFailed(RuntimeError):
    """A calibration that did not give a result; `reason` goes into the Calibrated condition (StartFailed: the
    model did not start; InvalidSpec; CalibrationFailed)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class CalibrationRequest:
    """One device kind of this node asked to answer a ModelSpec's volga.dev/calibrate token."""

    namespace: str
    name: str
    token: str
    kind: str  # cpu, or the GPU product: status.calibrated's key
    device: str  # where to measure: cpu or cuda:N


def _answer(status: Mapping[str, Any] | None, kind: str) -> api.CalibrationAnswer | None:
    for entry in (status or {}).get("calibratedFor") or ():
        if entry.get("device") == kind:
            try:
                return api.CalibrationAnswer.model_validate(entry)
            except pydantic.ValidationError:
                return None
    return None


def _held(answer: api.CalibrationAnswer, now: float) -> bool:
    """A running answer whose node renewed its lease in time."""
    renewed = conditions.unix(answer.renewed_at)
    return answer.condition.status == "Unknown" and renewed is not None and now < renewed + answer.lease_sec


def _replaced(entries: Sequence[Mapping[str, Any]] | None, entry: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The list keyed by device with `entry` in place of the one of its device."""
    kept = [e for e in entries or () if e.get("device") != entry["device"]]
    return sorted([*kept, entry], key=lambda e: str(e.get("device")))


def measured_baselines(objects: Mapping[tuple[str, str], Any],
                       specs: Mapping[str, api.ModelSpecSpec]) -> dict[str, tuple[api.Calibration, ...]]:
    """model id -> the ModelSpec status' calibrated entries that hold for its current version and input hash."""
    out: dict[str, tuple[api.Calibration, ...]] = {}
    for (ns, name), obj in objects.items():
        spec = specs.get(f"{ns}/{name}")
        if spec is None:
            continue
        held = []
        for entry in (obj.get("status") or {}).get("calibrated") or ():
            try:
                calibration = api.Calibration.model_validate(entry)
            except pydantic.ValidationError:
                continue
            if calibration.holds_for(spec.version, spec.input_hash()):
                held.append(calibration)
        if held:
            out[spec.model_id] = tuple(held)
    return out


class Calibrations:
    """Calibration requests (`labels.ANNOTATION_CALIBRATE` on a ModelSpec) that this node answers, one at a time
    on a thread of their own, never on a watch's or a request's path.

    A node takes a request for each device kind (GPU product, or cpu) it holds an EMI of the ModelSpec on. Of
    the nodes of one kind exactly one measures: the request is claimed by writing the kind's status.calibratedFor
    entry (token, node, condition Unknown, renewedAt) with the ModelSpec's resourceVersion as a precondition, so
    of two nodes claiming at once the API server answers one with 409 Conflict, and that one reads the claim and
    leaves it. The claim is a lease, renewed every third of `lease_sec` while measuring; a claim not renewed in
    time (its node died) is taken over. The result goes into status.calibrated (the kind's entry replaced) and
    the entry's condition turns True, or False with the reason; every status write is conditional the same way.
    A token once answered is not measured again; a new token is.
    """

    def __init__(self, custom: Any, node: str, calibrator: Calibrator, bucket: ratelimit.TokenBucket,
                 specs: Callable[[], Mapping[str, api.ModelSpecSpec]], lease_sec: int = LEASE_SEC) -> None:
        self.custom = custom
        self.node = node
        self.calibrator = calibrator
        self.bucket = bucket
        self.specs = specs
        self.lease_sec = lease_sec
        self.done = 0  # calibrations run by this node, for tests and logs
        self._queue: queue.Queue[CalibrationRequest | None] = queue.Queue()
        self._queued: set[CalibrationRequest] = set()
        self._running: CalibrationRequest | None = None
        self._seen: list[CalibrationRequest] = []  # the requests of the latest consider(), looked at again
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="calibrate", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop taking requests; a measurement under way is left to finish in its own process."""
        self._stop.set()
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def consider(self, objects: Mapping[tuple[str, str], Any], emis: Mapping[tuple[str, str], Any],
                 gpus_found: Sequence[gpus.GpuInfo]) -> list[CalibrationRequest]:
        """Queue the requests this node should take up, from the ModelSpecs and this node's EMIs; the ones queued
        now."""
        devices: dict[tuple[str, str], dict[str, str]] = {}  # ModelSpec -> kind -> device (lowest EMI name)
        for (ns, _name), emi in sorted(emis.items()):
            spec = emi.get("spec") or {}
            if spec.get("node") != self.node or emi["metadata"].get("deletionTimestamp"):
                continue
            index = (spec.get("gpu") or {}).get("index")
            device = "cpu" if index is None else f"cuda:{index}"
            kind = gpus.kind_of(device, gpus_found)
            devices.setdefault((ns, str(spec.get("modelSpec", ""))), {}).setdefault(kind, device)
        wanted = []
        for (ns, name), obj in objects.items():
            token = ((obj.get("metadata") or {}).get("annotations") or {}).get(labels.ANNOTATION_CALIBRATE)
            if not token:
                continue
            for kind, device in devices.get((ns, name), {}).items():
                wanted.append(CalibrationRequest(ns, name, token, kind, device))
        with self._lock:
            self._seen = wanted
        queued = []
        for request in wanted:
            status = objects[(request.namespace, request.name)].get("status")
            if not self._answered(_answer(status, request.kind), request.token) and self._enqueue(request):
                queued.append(request)
        return queued

    def _answered(self, answer: api.CalibrationAnswer | None, token: str) -> bool:
        if answer is None or answer.token != token:
            return False
        if answer.condition.status != "Unknown":
            return True
        if answer.node != self.node:
            return _held(answer, time.time())
        return False  # ours but not running here (this agent restarted): take it up again

    def _enqueue(self, request: CalibrationRequest) -> bool:
        with self._lock:
            if request in self._queued or request == self._running:
                return False
            self._queued.add(request)
        self._queue.put(request)
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                request = self._queue.get(timeout=self.lease_sec / 3)
            except queue.Empty:
                self._recheck()  # a lease that ran out raises no event
                continue
            if request is None:
                return
            with self._lock:
                self._queued.discard(request)
                self._running = request
            try:
                self._take(request)
            except Exception:
                log.exception("calibration %s/%s (%s): failed", request.namespace, request.name, request.kind)
            finally:
                with self._lock:
                    self._running = None

    def _recheck(self) -> None:
        with self._lock:
            seen = list(self._seen)
        now = time.time()
        for request in seen:
            try:
                obj = self.custom.get_namespaced_custom_object(api.GROUP, api.VERSION, request.namespace,
                                                               "modelspecs", request.name, _request_timeout=10)
            except kube_client.TRANSIENT as exc:
                log.debug("calibration recheck: %s", exc)
                continue
            answer = _answer(obj.get("status"), request.kind)
            if answer is not None and answer.token == request.token and answer.condition.status == "Unknown" \
                    and not _held(answer, now):
                self._enqueue(request)

    # -- one request ---------------------------------------------------------------------------------

    def _write(self, request: CalibrationRequest, build: Callable[[dict[str, Any]], dict[str, Any] | None]) -> bool:
        """Patch the ModelSpec's status with what `build(current object)` returns (None: nothing to write),
        conditional on the resourceVersion read; read again on a conflict. False when nothing was written."""
        for _ in range(20):
            if self._stop.is_set():
                return False
            try:
                obj = self.custom.get_namespaced_custom_object(api.GROUP, api.VERSION, request.namespace,
                                                               "modelspecs", request.name, _request_timeout=10)
                status = build(obj)
                if status is None:
                    return False
                body = {"metadata": {"resourceVersion": obj["metadata"]["resourceVersion"]}, "status": status}
                self.bucket.acquire()  # not ratelimit.write_sync: a conflict is answered by reading again
                self.custom.patch_namespaced_custom_object_status(api.GROUP, api.VERSION, request.namespace,
                                                                  "modelspecs", request.name, body,
                                                                  _request_timeout=10)
                return True
            except kubernetes.client.ApiException as exc:
                if exc.status == 404:
                    return False
                if exc.status == 409:
                    log.info("calibration %s/%s: the ModelSpec changed since read: reading it again",
                             request.namespace, request.name)
                else:
                    log.info("calibration %s/%s: status write deferred: %s", request.namespace, request.name,
                             exc.reason)
                    self._stop.wait(1.0)
            except kube_client.TRANSIENT as exc:
                log.info("calibration %s/%s: status write deferred: %s", request.namespace, request.name, exc)
                self._stop.wait(1.0)
        return False

    def _entry(self, request: CalibrationRequest, state: str, reason: str, message: str,
               previous: api.CalibrationAnswer | None) -> dict[str, Any]:
        now = conditions.timestamp()
        before = [previous.condition.to_wire()] if previous is not None and previous.token == request.token else []
        condition = conditions.condition(CALIBRATED, state == "True", reason, message, before, now)
        condition["status"] = state  # Unknown while measuring
        return api.CalibrationAnswer.model_validate({
            "device": request.kind, "token": request.token, "node": self.node, "renewedAt": now,
            "leaseSec": self.lease_sec, "condition": condition}).to_wire()

    def _take(self, request: CalibrationRequest) -> None:
        def claim(obj: dict[str, Any]) -> dict[str, Any] | None:
            token = ((obj.get("metadata") or {}).get("annotations") or {}).get(labels.ANNOTATION_CALIBRATE)
            status = obj.get("status") or {}
            answer = _answer(status, request.kind)
            if token != request.token or self._answered(answer, request.token):
                return None  # another node has it, or the request changed (its own event queues it)
            entry = self._entry(request, "Unknown", "Measuring", f"measuring on node {self.node}", answer)
            return {"calibratedFor": _replaced(status.get("calibratedFor"), entry)}

        if not self._write(request, claim):
            return
        where = f"{request.namespace}/{request.name} on {request.kind} ({request.device}, token {request.token!r})"
        log.warning("calibrating %s", where)
        renewing = threading.Event()
        renewer = threading.Thread(target=self._renew, args=(request, renewing), name="calibrate-lease",
                                   daemon=True)
        renewer.start()
        result: api.Calibration | None = None
        try:
            spec = self.specs().get(f"{request.namespace}/{request.name}")
            if spec is None:
                raise CalibrationFailed("InvalidSpec", "the ModelSpec is not valid on this node (its model file, "
                                                       "inputs or outputs)")
            result = self.calibrator(spec, request.device).model_copy(update={"device": request.kind,
                                                                              "node": self.node})
            reason, message = "Calibrated", (
                f"measured on node {self.node} through the {result.measured_through}, version {result.version}: "
                + ", ".join(f"batch {b.batch_size} p99 {b.p99_ms:g} ms" for b in result.batches))
        except CalibrationFailed as exc:
            reason, message = exc.reason, str(exc)
        except Exception as exc:
            reason, message = "CalibrationFailed", f"{type(exc).__name__}: {exc}"
        finally:
            renewing.set()
            renewer.join()
        self.done += 1
        log.warning("calibration %s: %s: %s", where, reason, message)

        def finish(obj: dict[str, Any]) -> dict[str, Any] | None:
            status = obj.get("status") or {}
            answer = _answer(status, request.kind)
            if answer is None or (answer.token, answer.node) != (request.token, self.node):
                log.warning("calibration %s: taken over by node %s, result dropped", where,
                            answer.node if answer else "?")
                return None
            entry = self._entry(request, "True" if result is not None else "False", reason, message, answer)
            out: dict[str, Any] = {"calibratedFor": _replaced(status.get("calibratedFor"), entry)}
            if result is not None:
                out["calibrated"] = _replaced(status.get("calibrated"), result.to_wire())
            return out

        self._write(request, finish)

    def _renew(self, request: CalibrationRequest, done: threading.Event) -> None:
        def renew(obj: dict[str, Any]) -> dict[str, Any] | None:
            status = obj.get("status") or {}
            answer = _answer(status, request.kind)
            if answer is None or (answer.token, answer.node) != (request.token, self.node):
                return None
            entry = answer.model_copy(update={"renewed_at": conditions.timestamp()}).to_wire()
            return {"calibratedFor": _replaced(status.get("calibratedFor"), entry)}

        while not done.wait(self.lease_sec / 3):
            self._write(request, renew)
