"""One executable model instance (EMI): a worker process and the tier it is in.

The tier state machine allows only these moves, the entries of `MOVES` (anything else raises
IllegalTransition):

    COLD      -> HOT                              spawn, load, warm up
    HOT       -> WARM | SUSPENDED | FROZEN | COLD
    WARM      -> HOT | COLD                       weights back from pinned host memory
    SUSPENDED -> HOT | FROZEN | COLD              driver restore + unlock
    FROZEN    -> HOT | SUSPENDED | COLD           CRIU restore (then driver restore on a GPU)

WARM and SUSPENDED need a GPU and the driver checkpoint API; on a CPU node the tiers are HOT, FROZEN and
COLD. Every move is timed and recorded. A wake that fails (a broken image, a worker that does not answer)
falls back to a cold start, is recorded with `fallback=True` and counted in `restore_failures`; what the
failed restore left is kept under the snapshot root's `failed/` folder. A lazy restore that fails is tried
once more eagerly from the same image before that.

A restore that hangs (a truncated pages file can leave criu spinning for good) is killed at its deadline
(`criu.Deadlines`) and handled like any failed restore. A dump killed at its deadline leaves a worker that may
be half-dumped: it is killed, and the instance is COLD. When the agent stops, the CRIU calls in flight are
cancelled (`criu.CriuCancelled`): the instance goes COLD without a cold start.

A restore can also succeed and bring back the wrong state (a damaged image). With `verify_restores`, the
instance records the model's answer to a fixed canary input before each snapshot and has the restored
worker answer it again before any request reaches it: a different answer is a failed restore.

With a shared snapshot store (`snapshot.shared`), COLD -> HOT first looks for an image another node published
under this instance's compatibility key and restores it (checked like any restore: the pages files' checksums
and the canary answer recorded when it was published); when none fits, or the one found fails, it cold-starts.
The first freeze of an instance whose key has no shared image yet publishes it, with the parked GPU weights its
image maps when it has any (the fetch puts them back at the path the image maps).

Freezing a GPU worker (its weights and the driver's copy parked outside the image) is `gpu_freeze`'s; starting,
watching and reaping the worker process is `process`'s; see docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pathlib
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np

from volga_agent.host import priority, process, throttle
from volga_agent.node import gpu_freeze, warmup_inputs
from volga_agent.snapshot import criu, cuda, shared
from volga_agent.worker import contract, protocol
from volga_core import api

Tier = api.Tier
log = logging.getLogger(__name__)

GPU_ONLY = frozenset({Tier.WARM, Tier.SUSPENDED})
MAX_SOCKET_PATH = 107


class IllegalTransition(ValueError):
    pass


class CanaryMismatch(RuntimeError):
    """A restored worker answered the canary differently from the worker that was snapshotted."""


@dataclasses.dataclass(frozen=True)
class Transition:
    source: Tier
    target: Tier
    seconds: float
    at: float
    fallback: bool = False
    detail: str = ""
    # Where a wake's time went, in seconds: "restore" (criu), "driver" (the CUDA driver's restore and unlock),
    # "wake" (the worker's own wake: parked weights back on the GPU, the canary answer), and the agent's own steps
    # between them: "adopt" (a restored process taken on: its priority, its parked pages premapped), "resume" (the
    # restore-complete file and signal), "release" (a lazy restore's remaining pages let go once it has woken).
    # Other moves carry those of these steps they share with a wake, or none.
    phases: Mapping[str, float] = dataclasses.field(default_factory=dict)


def decls(tensors: Sequence[api.TensorSpec]) -> tuple[contract.TensorDecl, ...]:
    """A ModelSpec's tensors as the worker declares them."""
    return tuple(contract.TensorDecl(t.name, t.dtype.value, tuple(t.shape)) for t in tensors)


def server_folder(spec: api.ModelSpecSpec) -> pathlib.Path:
    """The folder a model server runs in: `server.workingDir` (relative to the source's folder, or absolute on the
    node), else the source's folder (for a source that is one file, the folder holding it)."""
    source = spec.source_path if spec.source_path.is_dir() else spec.source_path.parent
    working = spec.server.working_dir if spec.server is not None else None
    return source / working if working else source


def worker_config(spec: api.ModelSpecSpec, workdir: pathlib.Path, device: str, cpus: tuple[int, ...] = (),
                  warmup_cache_ratio: float | None = None, reset_rng_on_restore: bool = False,
                  cuda_stack_bytes: int = contract.DEFAULT_CUDA_STACK_BYTES,
                  worker_user: tuple[int, int] = contract.NOBODY,
                  model_roots: Sequence[str] = (), graphs_in_images: bool = False) -> contract.WorkerConfig:
    """The worker's configuration from its ModelSpec and the node's defaults: `warmup_cache_ratio` applies
    where the ModelSpec sets none; `reset_rng_on_restore` makes every restored copy re-seed, whatever the
    ModelSpec says (otherwise its runtime.resetRngOnRestore decides); the worker drops to `worker_user`
    (uid, gid; (0, 0) keeps it root) once started, and refuses a model file it opens outside `model_roots`."""
    return warmup_inputs.configure(contract.WorkerConfig(
        model_id=spec.model_id, framework=spec.framework.value, path=str(spec.source_path),
        inputs=decls(spec.inputs), outputs=decls(spec.outputs), socket=str(workdir / "worker.sock"),
        signal_dir=str(workdir / "signals"), device=device, warmup_iterations=spec.runtime.warmup_iterations,
        reset_rng_on_restore=spec.runtime.reset_rng_on_restore or reset_rng_on_restore,
        intra_op_threads=spec.runtime.intra_op_threads,
        max_batch_size=spec.runtime.max_batch_size,
        cuda_graph_batches=tuple(sorted(int(b) for b in spec.slo.baseline_latency_ms) or (1, 8))
        if spec.hardware.cuda_graphs and device.startswith("cuda") else (),
        cpus=cpus, precision=spec.hardware.precision.value, uid=worker_user[0], gid=worker_user[1],
        model_roots=tuple(str(pathlib.Path(root).resolve()) for root in model_roots),
        cuda_stack_bytes=cuda_stack_bytes if device.startswith("cuda") else 0, graphs_in_images=graphs_in_images,
        restore_warmups=round((spec.runtime.warmup_cache_ratio or warmup_cache_ratio or 0.0)
                              * spec.runtime.warmup_iterations)), spec)


# The folder under the snapshot root for parked GPU weights (a name no ModelSpec can have).
PARKED = ".parked"
# How long a freeze waits for a lazily restored worker's remaining pages (the lazy-pages daemon streams them in
# the background at the page-fault rate: about a second per GB).
LAZY_PAGES_TIMEOUT_SEC = 120.0
# What a failed wake raises: the restore, the driver, the restored worker or its canary answer.
WAKE_ERRORS = (criu.CriuError, cuda.DriverCheckpointError, process.WorkerStartError, protocol.ProtocolError,
               protocol.WorkerError, CanaryMismatch, OSError)
SHARED_ERRORS = (*WAKE_ERRORS, shared.SharedImageError)


class Instance:
    """Owns one worker and moves it between tiers. Not thread-safe: the pool serialises calls per instance."""

    def __init__(self, name: str, spec: api.ModelSpecSpec, workdir: str | pathlib.Path,
                 criu_engine: criu.CriuEngine | None, driver: cuda.DriverCheckpoint | None = None,
                 device: str = "cpu", start_timeout: float = 120.0, pid_namespace: bool | None = None,
                 reuse_image_sec: float = 0.0, lazy_restore: bool = False, cpus: tuple[int, ...] = (),
                 warmup_cache_ratio: float | None = None, reset_rng_on_restore: bool = False,
                 verify_restores: bool = True, park_weights: bool = True,
                 die_with_agent: bool = True, shared_store: shared.Context | None = None,
                 cuda_stack_bytes: int = contract.DEFAULT_CUDA_STACK_BYTES,
                 worker_user: tuple[int, int] = contract.NOBODY, unprivileged_snapshots: bool = False,
                 model_roots: Sequence[str] = (), graphs_in_images: bool = False,
                 park_driver_copy: bool = True) -> None:
        self.name = name
        self.spec = spec
        self.workdir = pathlib.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        process.claim(self.workdir)
        # CUDA does not work inside a PID namespace that shares the host's /proc (cudaErrorOperatingSystem).
        self.pid_namespace = not device.startswith("cuda") if pid_namespace is None else pid_namespace
        # Workers drop to `worker_user` where the tiers they may reach allow it (docs/security.md).
        self.root_reason = process.must_stay_root(self.pid_namespace, criu_engine is not None,
                                                  unprivileged_snapshots) \
            if worker_user != (0, 0) else ""
        if self.root_reason:
            log.info("%s: the worker stays root: %s", name, self.root_reason)
        self.config = worker_config(spec, self.workdir, device, cpus, warmup_cache_ratio, reset_rng_on_restore,
                                    cuda_stack_bytes, (0, 0) if self.root_reason else worker_user, model_roots,
                                    graphs_in_images)
        if len(self.config.socket) > MAX_SOCKET_PATH:
            raise ValueError(f"socket path {self.config.socket} is longer than {MAX_SOCKET_PATH} bytes: "
                             "use a shorter run folder")
        self.signals = pathlib.Path(self.config.signal_dir)
        self.logfile = self.workdir / "worker.log"
        self.criu = criu_engine
        self.driver = driver
        self.device = device
        self.start_timeout = start_timeout
        self.tier = Tier.COLD
        self.pid: int | None = None
        self.image: criu.Image | None = None
        # An image younger than this, of a worker whose state has not changed since (same generation), is
        # still a faithful snapshot: freezing again just drops the process. 0 dumps on every freeze.
        self.reuse_image_sec = reuse_image_sec
        self.lazy_restore = lazy_restore
        self.verify_restores = verify_restores
        # A GPU worker frozen from HOT parks its weights in a file beside the images (`parked_dir`), which its
        # image maps by reference: the image and its restore then carry only the process and the CUDA context.
        self.park_weights = park_weights
        # The parked weights' folder, and the file in it the current image maps (`gpu_freeze.Parking`).
        self.parking = gpu_freeze.Parking(
            criu_engine.root / PARKED / self.workdir.name if criu_engine is not None else None)
        # With them, the driver's copy of the device memory goes into the same file, by reference too
        # (`gpu_freeze.Freeze.park_driver_copy`): the image leaves it out and its restore maps it from the page cache.
        self.park_driver_copy = park_driver_copy
        self.die_with_agent = die_with_agent
        # (worker generation, digest of its canary answer); None until recorded, or when the model's answer
        # to the canary is not reproducible and so cannot tell a damaged restore.
        self._canary: tuple[int, str] | None = None
        self._phases: dict[str, float] = {}  # the current move's phases (see Transition.phases)
        self._canary_usable = True
        self._image_generation = -1
        self._snapshot_generation = -1  # the worker state last snapshotted, by CRIU or the driver
        self._image_taken = 0.0
        # Pinned host memory the worker held when the driver last checkpointed it (its reply to `sleep`): the
        # driver's restore of such a worker fails on pages still to come through CRIU's lazy pages, so an image of
        # it is restored eagerly (`criu.Image.lazy_restorable`).
        self._pinned_at_suspend = 0
        self.history: list[Transition] = []
        self.restore_failures = 0
        self.lazy_restore_failures = 0  # lazy restores that failed and were served by an eager one
        # What the worker said of the driver's copy at the last freeze (`gpu_freeze`): bytes, regions,
        # seconds, or the error that left it in the image; and the bytes of it an earlier restore had left mapped
        # from a parked file that was going (stale_bytes).
        self.driver_copy: dict[str, object] = {}
        self.last_used = time.monotonic()
        self._client: protocol.WorkerClient | None = None
        self._paused = False  # the worker waits in its pause hook (after a restore into SUSPENDED)
        self._restored: criu.Restored | None = None  # the CRIU restore the running worker came from
        self.shared = shared_store if criu_engine is not None else None
        self.shared_restores = 0  # cold starts served by a shared image
        self.shared_restore_failures = 0  # shared images that failed their restore or its checks
        self.shared_publishes = 0
        self.shared_from = ""  # the digest of the shared image the running worker came from
        self.shared_published = ""  # the digest of the last shared image this instance published
        # What the worker's warm-up found (`contract.WarmupReport`), as the worker last told it after a cold start or
        # a shared image's restore; None until then. Counted: made-up warm-ups skipped, outputs found contradicting.
        self.warmup: contract.WarmupReport | None = None
        self.warmups_skipped = 0
        self.output_mismatches = 0
        if not spec.source_path.exists():
            raise FileNotFoundError(f"spec.source: model file {spec.source_path} does not exist")

    # -- worker process ------------------------------------------------------------------------------

    def worker_gone(self) -> bool:
        """Whether the worker this instance counts on (HOT, WARM or SUSPENDED) has exited."""
        return self.pid is not None and process.exited(self.pid, grace=0)

    def _wait_for(self, pid: int, predicate: Callable[[], bool], what: str, timeout: float) -> None:
        process.wait_for(self.name, pid, predicate, what, timeout, self.signals, self.logfile)

    def _kill(self) -> None:
        self.disconnect()
        if self._restored is not None:
            self._restored.stop()
        self._paused, self._restored = False, None
        if self.pid is not None:
            process.kill(self.pid)
            self.pid = None

    @property
    def restored(self) -> criu.Restored | None:
        """The CRIU restore the running worker came from, until its lazy pages have all arrived."""
        return self._restored

    def client(self) -> protocol.WorkerClient:
        if self._client is None:
            self._client = protocol.WorkerClient(self.config.socket)
        return self._client

    def disconnect(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _announce(self) -> None:
        """Name this agent as the one a paused (or restored) worker waits for."""
        self.signals.mkdir(parents=True, exist_ok=True)
        contract.publish(self.signals, contract.AGENT, contract.process_identity(os.getpid()))

    def _resume_worker(self, pid: int) -> None:
        """Tell a paused (or restored) worker to carry on serving: the restore-complete hook. The file holds our
        PID, against which the worker arms its parent-death signal again (published whole, by a rename)."""
        self._paused = False
        with self._phase("resume"):
            contract.publish(self.signals, contract.RESTORE_COMPLETE, str(os.getpid()))
            os.kill(pid, contract.WAKE_SIGNAL)

    # -- tiers ---------------------------------------------------------------------------------------

    def _record(self, source: Tier, target: Tier, start: float, fallback: bool = False,
                detail: str = "") -> Transition:
        phases, self._phases = self._phases, {}
        t = Transition(source, target, time.perf_counter() - start, time.time(), fallback, detail,
                       {} if fallback else phases)
        self.history.append(t)
        self.tier = target
        return t

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._phases[name] = self._phases.get(name, 0.0) + time.perf_counter() - start

    def to(self, target: Tier) -> Transition:
        """Make the move from the current tier to `target` that `MOVES` holds; a failed wake cold-starts."""
        source = self.tier
        if target == source:
            return Transition(source, target, 0.0, time.time(), detail="already there")
        self._phases = {}
        move = MOVES.get((source, target))
        if move is None:
            raise IllegalTransition(f"{self.name}: {source.value} -> {target.value} is not a legal move")
        if target in GPU_ONLY and not self.gpu:
            raise IllegalTransition(f"{self.name}: {target.value} needs a GPU and the driver checkpoint API")
        if target == Tier.FROZEN and self.criu is None:
            raise IllegalTransition(f"{self.name}: FROZEN needs CRIU (scripts/install-criu.sh)")
        start = time.perf_counter()
        try:
            detail = move.run(self) or ""
        except criu.CriuCancelled:
            if move.wake:  # the agent is stopping: no cold start now, and nothing half-restored left running
                self._to_cold()
                self._record(source, Tier.COLD, start, detail="stopped by the agent")
            raise
        except WAKE_ERRORS as exc:
            if not move.wake:
                raise
            self._keep_failure()
            # A lazy restore that failed is tried once eagerly, unless it ran out its deadline: criu spinning on a
            # damaged image would spin again for a whole deadline before the cold start.
            if source == Tier.FROZEN and self.lazy_restore and self.image is not None and \
                    self.image.lazy_restorable and not isinstance(exc, criu.CriuTimeout):
                eager = self._eager_retry(target, exc)
                if eager is not None:
                    return self._record(source, target, start, detail=eager)
            # A wake failed: whatever is left of the instance goes, and a cold start takes its place.
            self.restore_failures += 1
            log.warning("%s: %s -> %s failed, cold start instead: %s", self.name, source.value, target.value, exc)
            self._to_cold()
            self._cold_start()
            return self._record(source, Tier.HOT, start, fallback=True, detail=str(exc))
        return self._record(source, target, start, detail=detail)

    def _eager_retry(self, target: Tier, exc: BaseException) -> str | None:
        """After a failed lazy restore, restore the same image once more with every page read up front."""
        log.warning("%s: lazy restore failed, restoring eagerly: %s", self.name, exc)
        self._kill()
        self.lazy_restore_failures += 1
        try:
            if target == Tier.HOT:
                self._frozen_to_hot(lazy=False)
            else:
                self._frozen_to_suspended(lazy=False)
        except criu.CriuCancelled:
            self._to_cold()
            self.tier = Tier.COLD
            raise
        except WAKE_ERRORS as again:
            self._keep_failure()
            log.warning("%s: eager restore failed too: %s", self.name, again)
            return None
        return f"lazy restore failed ({exc}); eager restore instead"

    def _keep_failure(self) -> None:
        """Keep what a failed restore left, for inspection; never in the way of the cold start that follows."""
        if self.image is not None and self.criu is not None:
            try:
                kept = self.criu.keep_failure(self.image, self.name, (self.logfile,))
            except OSError as exc:
                log.warning("%s: could not keep what the failed restore left: %s", self.name, exc)
                return
            if kept is not None:
                log.warning("%s: what the failed restore left is kept in %s", self.name, kept)

    def wake(self) -> Transition:
        self.last_used = time.monotonic()
        return self.to(Tier.HOT)

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.tier != Tier.HOT:
            raise protocol.WorkerError("UNAVAILABLE", f"{self.name} is {self.tier.value}, not HOT: wake it first")
        self.last_used = time.monotonic()
        try:
            return self.client().infer(inputs)
        except (OSError, protocol.ProtocolError) as exc:
            self.disconnect()
            if self.pid is not None and process.exited(self.pid, grace=0.5):
                self.pid = None
                self.tier = Tier.COLD
                self.history.append(Transition(Tier.HOT, Tier.COLD, 0.0, time.time(), detail="worker died"))
            raise protocol.WorkerError("UNAVAILABLE", f"{self.name}: worker connection lost: {exc}") from exc

    @property
    def shared_key(self) -> shared.Key | None:
        if self.shared is None:
            return None
        # A restored worker holds the paths it had: its work folder, and the parked weights its image maps.
        folder = self.parked_dir if self.gpu and self.park_weights else None
        parked = str(folder.absolute()) if folder is not None else ""
        return self.shared.facts.key(self.spec.model_id, self.spec.version, self.spec.input_hash(),
                                     self.spec.framework.value, self.device.startswith("cuda"),
                                     str(self.workdir.absolute()), parked, self.spec.source_digest or "")

    def _cold_to_hot(self) -> str | None:
        """Restore a compatible shared image when one exists, else (or when it fails) cold start."""
        self.shared_from = ""
        key = self.shared_key
        entry = self.shared.store.find(key) if self.shared is not None and key is not None else None
        detail = None
        if entry is not None:
            assert self.shared is not None
            try:
                self._restore_shared(entry)
                self.shared_restores += 1
                self.shared_from = entry.digest
                return f"restored from shared image {entry.digest} of node {entry.manifest.node}"
            except criu.CriuCancelled:
                self._to_cold()
                raise
            except SHARED_ERRORS as exc:
                self._keep_failure()
                self.shared_restore_failures += 1
                log.warning("%s: shared image %s failed, cold start instead: %s", self.name, entry.digest, exc)
                self._to_cold()
                self.shared.store.discard(entry.digest)  # damaged: no other node should try it
                detail = f"shared image {entry.digest} failed ({exc}); cold start"
        self._cold_start()
        return detail

    def _restore_shared(self, entry: shared.Entry) -> None:
        assert self.shared is not None and self.criu is not None
        self.image = self.shared.store.fetch(entry, self.criu.root / self.name / f"shared-{uuid.uuid4().hex[:8]}",
                                             self.parked_dir)
        if entry.manifest.parked is not None:
            # The weights the image maps, placed by fetch.
            self.parking.current = pathlib.Path(entry.manifest.parked.path)
        self.shared.store.place_log(entry, self.logfile)
        self.signals.mkdir(parents=True, exist_ok=True)
        generation = entry.manifest.generation
        self._canary = (generation, entry.manifest.canary)
        self._snapshot_generation = self._image_generation = generation
        self._image_taken = time.monotonic()
        self._frozen_to_hot(lazy=False)
        self._read_warmup()  # the image's worker warmed up on another node: what it found there

    def _publish(self, generation: int, parked: pathlib.Path | None) -> None:
        """Publish the image just dumped, with the parked weights it maps (`parked`), when the store has none of
        this key (never one without a canary answer of its state)."""
        key = self.shared_key
        if (self.shared is None or key is None or self.image is None
                or self._canary is None or self._canary[0] != generation or self.shared.store.find(key)):
            return
        try:
            entry = self.shared.store.publish(self.image, key, self.shared.node, self._canary[1], generation,
                                              self.logfile, parked)
        except (OSError, shared.SharedImageError) as exc:
            log.warning("%s: cannot publish the shared image: %s", self.name, exc)
            return
        if entry is not None:
            self.shared_publishes += 1
            self.shared_published = entry.digest

    def _cold_start(self) -> None:
        pid = process.spawn(self.name, self.config, self.workdir, self.logfile, self.pid_namespace,
                            self.die_with_agent)
        self.pid = pid
        try:
            self._wait_for(pid, lambda: (self.signals / contract.READY).exists(), "ready", self.start_timeout)
            generation = int(self.client().call("ping").header.get("generation", 0))
            self._read_warmup()
            self._record_canary(generation, twice=True)
        except BaseException:
            self._kill()  # a worker that did not start is not left behind, nor its zombie
            raise

    def _read_warmup(self) -> None:
        """Ask the worker what its warm-up found (`contract.WarmupReport`): a made-up warm-up the model refused (it
        serves unwarmed), answers that contradict the declared outputs. Logged and counted once per start."""
        try:
            report = contract.WarmupReport.from_wire(self.client().call("warmup").header)
        except protocol.WorkerError as exc:  # a worker of an image that predates the op
            log.info("%s: the worker does not say what its warm-up found: %s", self.name, exc)
            return
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("%s: the worker's warm-up report is not one: %s", self.name, exc)
            return
        self.warmup = report
        if report.skipped:
            self.warmups_skipped += 1
            log.warning("%s: warm-up skipped: %s", self.name, report.skipped)
        if report.mismatch:
            self.output_mismatches += 1
            log.warning("%s: %s (the gateway's metadata says the answered shapes)", self.name, report.mismatch)

    def _record_canary(self, generation: int, twice: bool = False) -> None:
        """Record the HOT worker's canary answer for its current state (`twice`: check it is reproducible)."""
        if not self.verify_restores or not self._canary_usable:
            return
        if self._canary is not None and self._canary[0] == generation:
            return
        try:
            answers = {self.client().call("canary").header["canary"] for _ in range(2 if twice else 1)}
        except protocol.WorkerError as exc:
            answers = set()
            log.warning("%s: the model cannot answer the canary input (%s)", self.name, exc)
        if len(answers) != 1:
            log.warning("%s: restores are not verified: the model's answer to the canary input is not "
                        "reproducible", self.name)
            self._canary_usable, self._canary = False, None
            return
        self._canary = (generation, answers.pop())

    def _verify(self, header: dict[str, object]) -> None:
        """Compare a restored worker's canary answer (in its wake reply) with the one recorded."""
        if self._canary is None or "canary" not in header:
            return
        if header["canary"] != self._canary[1]:
            raise CanaryMismatch(f"{self.name}: the restored worker answers the canary input differently from "
                                 "the worker that was snapshotted: the snapshot is damaged")

    def _wake_worker(self) -> None:
        """The restored (or resumed) worker serves again, once its canary answer matches."""
        verify = self._canary is not None and self._canary[0] == self._snapshot_generation
        with self._phase("wake"):
            self._verify(self.client().call("wake", canary=verify).header)

    def _to_cold(self) -> None:
        self._kill()
        if self.image is not None and self.criu is not None:
            self.criu.remove(self.image)
        self.image = None
        self.parking.drop()

    @property
    def verifies_restores(self) -> bool:
        """Whether restores of this instance are checked against a recorded canary answer."""
        return self._canary is not None

    @property
    def gpu(self) -> bool:
        """On a GPU with the driver checkpoint API: the WARM and SUSPENDED tiers exist for it."""
        return self.driver is not None and self.device.startswith("cuda")

    def _hot_to_warm(self) -> None:
        self.client().call("offload")

    def _warm_to_hot(self) -> None:
        with self._phase("wake"):
            self.client().call("reload")

    def _hot_to_suspended(self) -> None:
        assert self.driver is not None and self.pid is not None
        self._snapshot_generation = self._generation()
        self._record_canary(self._snapshot_generation)
        # Requests that reach the worker directly (gateways) are handed back from now on instead of blocking
        # on the driver's lock; the gateway then asks for a wake.
        self._sleep()
        try:
            self.driver.suspend(self.pid)
        except cuda.DriverCheckpointError:
            self.client().call("wake")  # still HOT
            raise

    def _sleep(self) -> None:
        """Tell the worker it is going into the driver's checkpoint (it makes what the driver copies smaller)."""
        reply = self.client().call("sleep", tier=Tier.SUSPENDED.value).header
        self._pinned_at_suspend = int(reply.get("pinned_bytes") or 0)
        self.disconnect()

    def _suspended_to_hot(self) -> None:
        assert self.driver is not None and self.pid is not None
        with self._phase("driver"):
            self.driver.resume(self.pid)
        if self._paused:
            self._resume_worker(self.pid)
        self._wake_worker()

    @property
    def parked_dir(self) -> pathlib.Path | None:
        """Where this instance's GPU weights wait while it is FROZEN (beside the snapshot images): named after its
        work folder, not the instance, so that both paths an image holds are the same for any replica in that
        folder's slot (see `pool.work_folder`)."""
        return self.parking.folder

    @property
    def parked_bytes(self) -> int:
        """The size of the weights the current image maps from outside itself (0 when none)."""
        return self.parking.size

    def _pause(self, park: pathlib.Path | None = None) -> None:
        """The pause hook: the worker closes its connections and says when it is ready to be dumped."""
        assert self.pid is not None
        if self._paused:
            return
        self._announce()
        self.client().call("prepare_checkpoint", park=str(park) if park is not None else "")
        self.disconnect()
        ready = self.signals / contract.READY_FOR_CHECKPOINT
        self._wait_for(self.pid, ready.exists, "ready for checkpoint", 30.0)

    def _dump(self, generation: int, lazy_restorable: bool = True, abandoned: Callable[[], None] | None = None) -> None:
        """Dump the paused worker (it ends with the dump). An abandoned dump calls `abandoned` (a GPU freeze gives the
        worker its GPU state back) and the worker carries on serving; one killed or cancelled leaves it COLD."""
        assert self.criu is not None  # to() refuses FROZEN without CRIU
        assert self.pid is not None
        old = self.image
        try:
            # The model's folder is watched: a file the image maps from it (ONNX external data) may be replaced.
            self.image = self.criu.dump(self.pid, self.name, watch=(self.spec.source_path.resolve().parent,))
        except (criu.CriuTimeout, criu.CriuCancelled) as exc:
            # criu was killed mid-dump: the worker may hold its parasite or be half-dumped; it is not trusted.
            self._gone_cold(f"dump stopped: {exc}")
            raise
        except criu.CriuError:
            # The dump was abandoned: give back what the freeze took, and carry on serving.
            if abandoned is not None:
                abandoned()
            self._resume_worker(self.pid)  # the worker copies parked weights back from its mapping
            raise
        self._image_generation, self._image_taken = generation, time.monotonic()
        if not lazy_restorable:
            self.image = dataclasses.replace(self.image, lazy_restorable=False)
        self._snapshot_generation = generation
        process.reap(self.pid)
        self.pid = None
        self._paused = False
        if old is not None:
            self.criu.remove(old)

    def _generation(self) -> int:
        """The worker's weights generation; a worker still paused since its restore has the one of its image."""
        if self._paused:
            return self._snapshot_generation
        return int(self.client().call("ping").header.get("generation", 0))

    def _reusable(self, generation: int) -> bool:
        return (self.image is not None and generation == self._image_generation
                and time.monotonic() - self._image_taken < self.reuse_image_sec)

    def _await_pages(self) -> None:
        """A worker restored lazily is dumped only once it holds all of its memory again: pages still in the
        old image would be missing from the new one, and come back as zeros (a corrupt heap) after its restore.
        A worker whose pages did not all arrive may fault on a missing one for good: it goes (COLD)."""
        if self._restored is not None:
            try:
                self._restored.wait_for_pages(LAZY_PAGES_TIMEOUT_SEC)
            except criu.CriuError as exc:
                self._gone_cold(str(exc))
                raise
            self._restored = None

    def _gone_cold(self, detail: str) -> None:
        """The worker can no longer be trusted: kill it and drop its image; the instance is COLD."""
        source = self.tier
        self._to_cold()
        self.tier = Tier.COLD
        self.history.append(Transition(source, Tier.COLD, 0.0, time.time(), detail=detail))

    def _hot_to_frozen(self) -> str | None:
        self._await_pages()
        generation = self._generation()
        self._record_canary(generation)
        if self._image_reused(generation):
            return "image reused"
        if self.gpu:  # its weights, then the driver's copy, parked outside the image where they can be
            gpu_freeze.Freeze(self, generation).from_hot()
            return None
        self._pause()  # requests that gateways just sent are handed back unrun, not reset
        self._dump(generation)
        self._publish(generation, None)
        return None

    def _image_reused(self, generation: int) -> bool:
        """An image still faithful to the worker (`reuse_image_sec`) stays: the worker is paused and dropped."""
        if not self._reusable(generation):
            return False
        self._pause()
        self._kill()
        return True

    def _suspended_to_frozen(self) -> str | None:
        """A worker restored into SUSPENDED is dumped as it is: it still maps the parked file its image had. A
        live SUSPENDED worker holds its weights (pinned, or in the driver's copy) and the driver's copy in its
        own memory, which an image would carry page by page and a restore fault back at the page-fault rate:
        where weights are parked, the driver gives its context back for the freeze and the worker, still asleep,
        is frozen the way a HOT one is, into the same small image (`gpu_freeze.Freeze.from_suspended`)."""
        self._await_pages()
        generation = self._generation()
        if self._image_reused(generation):
            return "image reused"
        gpu_freeze.Freeze(self, generation).from_suspended()
        return None

    def _restore(self, lazy: bool | None, wake: bool = False) -> int:
        if self.image is None or self.criu is None:
            raise criu.CriuError(f"{self.name}: no image to restore")
        pathlib.Path(self.config.socket).unlink(missing_ok=True)
        (self.signals / contract.RESTORE_COMPLETE).unlink(missing_ok=True)
        self._announce()
        with self._phase("restore"):
            lazy = (self.lazy_restore if lazy is None else lazy) and self.image.lazy_restorable
            restored = self.criu.restore(self.image, lazy=lazy, wake=wake, gpu=self.gpu)
        self.pid, self._restored = restored.pid, restored
        with self._phase("adopt"):
            priority.normalise(restored.pid)  # the image kept its threads' nice: it may have been taken while yielding
            throttle.resume(restored.pid)  # an image of a stopped worker would restore it stopped
            if self.gpu:  # the driver's copy mapped from the parked file: its page tables filled beside its restore
                self.parking.premap([restored.pid])
        return restored.pid

    def _frozen_to_suspended(self, lazy: bool | None = None) -> None:
        self._restore(lazy)
        self._paused = True  # ready for the driver's restore at the wake

    def _frozen_to_hot(self, lazy: bool | None = None) -> None:
        pid = self._restore(lazy, wake=True)
        if self.gpu:
            assert self.driver is not None
            with self._phase("driver"):
                self.driver.resume(pid)
            if self._restored is not None:  # what faulted until here is wanted first at the next wake
                self._restored.end_record()
        self._resume_worker(pid)
        self._wake_worker()  # an image taken in SUSPENDED holds a worker that was told to sleep
        if self._restored is not None:  # awake: the lazy pages the wake did not ask for come now
            with self._phase("release"):
                self._restored.release()

    def close(self) -> None:
        """Stop the worker and remove every image this instance owns."""
        self._to_cold()
        if self.criu is not None:
            self.criu.remove_all(self.name)
        self.tier = Tier.COLD


@dataclasses.dataclass(frozen=True)
class Move:
    """One legal tier move: the method that makes it, and whether it is a wake (a failure of which falls back
    to a cold start, after an eager retry where a lazy restore failed)."""

    run: Callable[[Instance], str | None]
    wake: bool = False


# The tier machine: every legal move and the method that makes it (the module docstring draws it). A move's
# method returns a detail to record, or None.
MOVES: dict[tuple[Tier, Tier], Move] = {
    (Tier.COLD, Tier.HOT): Move(Instance._cold_to_hot),
    (Tier.HOT, Tier.WARM): Move(Instance._hot_to_warm),
    (Tier.HOT, Tier.SUSPENDED): Move(Instance._hot_to_suspended),
    (Tier.HOT, Tier.FROZEN): Move(Instance._hot_to_frozen),
    (Tier.HOT, Tier.COLD): Move(Instance._to_cold),
    (Tier.WARM, Tier.HOT): Move(Instance._warm_to_hot, wake=True),
    (Tier.WARM, Tier.COLD): Move(Instance._to_cold),
    (Tier.SUSPENDED, Tier.HOT): Move(Instance._suspended_to_hot, wake=True),
    (Tier.SUSPENDED, Tier.FROZEN): Move(Instance._suspended_to_frozen),
    (Tier.SUSPENDED, Tier.COLD): Move(Instance._to_cold),
    (Tier.FROZEN, Tier.HOT): Move(Instance._frozen_to_hot, wake=True),
    (Tier.FROZEN, Tier.SUSPENDED): Move(Instance._frozen_to_suspended, wake=True),
    (Tier.FROZEN, Tier.COLD): Move(Instance._to_cold),
}
# The targets each tier can move to (the pool walks through HOT to reach the others).
LEGAL: dict[Tier, frozenset[Tier]] = {
    tier: frozenset(target for source, target in MOVES if source == tier) for tier in Tier
}
