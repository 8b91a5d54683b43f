"""The GPU freeze: a GPU worker into a small CRIU image, its weights and the driver's copy parked beside it.

The instance (`instance.Instance`) keeps the tier machine and decides that a worker is frozen: it waits for the
pages of a lazy restore, reads the worker's generation, and keeps an image still fresh (`reuse_image_sec`). What
follows on a GPU is this module's, as named phases of a `Freeze`, over the mechanisms: the CUDA driver's checkpoint
API (`snapshot.cuda`), CRIU (`snapshot.criu`, through the instance's dump) and the worker's half (`worker.regions`,
`serve`). docs/architecture.md ("Freezing a GPU worker") tells the whole sequence.

From HOT (`Freeze.from_hot`):

1. `park`: the worker is paused for its dump with a fresh file beside the images (`Parking`) into which it copies
   its weights and maps them: the image records that mapping by path instead of carrying the weights. With
   `park_weights` off, it is paused with none.
2. `checkpoint`: the driver checkpoints the paused worker (lock + checkpoint): its device memory lands in host
   memory, the driver's copy. The pages present before are read first, to tell that copy afterwards.
3. `park_driver_copy` (timed as the phase "park_driver_copy"): the worker maps the pages the driver's checkpoint
   filled from the same parked file, so that the image leaves them out too (with `park_driver_copy` and parked
   weights only).
4. `capture`: CRIU dumps the worker; the parked file the image maps is kept (older ones go), and the instance
   publishes the image to the shared store where it has none of its key.

From SUSPENDED (`Freeze.from_suspended`): a worker restored into SUSPENDED and still paused is dumped as it is (it
still maps the parked file of the image it came from). A live one holds its weights (pinned) and the driver's copy in
its own memory, which an image would carry page by page: where weights are parked, `context_back` (timed as the
phase "driver") has the driver restore its context, and the worker, still asleep, goes through 1-4 as from HOT.

Fallbacks:

- /proc does not show the paused worker's pages, or the worker cannot move them (it says why, in `driver_copy`):
  the driver's copy stays in the image, which is only slower. A worker that does not answer goes COLD.
- The driver cannot checkpoint the paused worker: the worker serves again, its parked file goes, the error is
  raised (the instance stays HOT).
- The dump is abandoned (a criu error): the driver gives the worker its GPU state back, the worker serves again and
  its parked file goes. A dump killed at its deadline or cancelled leaves a worker that is not trusted: COLD.
- The driver cannot give a SUSPENDED worker its context back and the process is still checkpointed: the image
  carries it all (`capture_all`), and is restored only eagerly where the worker held pinned memory at the driver's
  checkpoint (a lazy restore of it failed the driver's restore every time on an H200). A process in any other
  state is not trusted: COLD.
- A freeze from SUSPENDED that fails once the context is back: the worker, asleep, goes back to the driver's
  checkpoint (`suspend_again`), or COLD where it cannot.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
from collections.abc import Callable, Collection
from typing import Protocol

from volga_agent.host import process
from volga_agent.snapshot import criu, cuda
from volga_agent.worker import contract, protocol, regions
from volga_core import api

log = logging.getLogger(__name__)


class Parking:
    """An instance's parked GPU weights: the folder they wait in while it is FROZEN (None without CRIU) and the
    file in it that its current image maps (None when it maps none)."""

    def __init__(self, folder: pathlib.Path | None) -> None:
        self.folder = folder
        self.current: pathlib.Path | None = None
        self.premapped: list[regions.Premap] = []  # the last restore's (`premap`)

    def new_file(self, generation: int, config: contract.WorkerConfig) -> pathlib.Path:
        """A fresh path in the folder for the weights of the worker of `config`, which may write there."""
        assert self.folder is not None
        self.folder.mkdir(parents=True, exist_ok=True)
        process.hand_over(self.folder, config)  # the worker writes its weights there
        return self.folder / f"weights-{generation}-{os.urandom(4).hex()}.bin"

    def drop(self, keep: pathlib.Path | None = None, mapped: Collection[pathlib.Path] = ()) -> None:
        """Remove parked files that no image maps any more: all but `keep` (the current image's) and `mapped`
        (others its process still mapped when it was dumped); the folder too when none is left."""
        self.current = keep
        folder = self.folder
        if folder is None or not folder.is_dir():
            return
        kept = {path.resolve() for path in mapped} | ({keep.resolve()} if keep is not None else set())
        for path in folder.iterdir():
            if path.resolve() not in kept:
                path.unlink(missing_ok=True)
        if not kept:
            folder.rmdir()

    def premap(self, pids: Collection[int]) -> None:
        """Start faulting the parked copies that processes `pids`, just restored, map from this folder into their
        page tables, beside the driver's restore that reads them (`regions.Premap`); kept in `premapped` until the
        next restore. A process /proc no longer shows is left out."""
        self.premapped = []
        if self.folder is None:
            return
        folder = self.folder.resolve()
        for pid in pids:
            try:
                ranges = regions.mapped_from(pid, folder)
            except OSError:
                continue
            started = regions.premap(pid, ranges)
            if started is not None:
                self.premapped.append(started)

    @property
    def size(self) -> int:
        """The size of the weights the current image maps from outside itself (0 when none)."""
        return self.current.stat().st_size if self.current is not None and self.current.exists() else 0


def to_park(pid: int, before: regions.Presence, parked: pathlib.Path) -> tuple[list[regions.Region], int]:
    """What a process checkpointed by the driver is to map from the file `parked`: the pages the checkpoint filled
    (`before` it, `regions.filled`) and what an earlier restore left mapped from the folder's other files, which are
    going (`regions.stale`); and the bytes of the latter. OSError where /proc does not show its pages."""
    stale = regions.stale(pid, parked.parent.resolve(), parked.resolve())
    return regions.filled(pid, before) + stale, sum(r.end - r.start for r in stale)


def parked_report(path: pathlib.Path, stale_bytes: int) -> dict[str, object]:
    """A process's answer to a request to park (`regions.move_as_named`), read as data and never trusted to be well
    formed (the process runs model code), with the stale bytes it was asked to move too; the file goes."""
    try:
        report = json.loads(contract.read_signal(path))
    except ValueError as exc:
        report = f"{exc}"
    path.unlink(missing_ok=True)
    if not isinstance(report, dict):
        report = {"error": f"unreadable report: {report!r:.200}"}
    return {**report, "stale_bytes": stale_bytes}


class Frozen(Protocol):
    """What a freeze needs of the instance whose worker it freezes (`instance.Instance`): the worker and its
    parked weights, and the instance's own steps around a dump, which a freeze on a CPU uses alone."""

    name: str
    pid: int | None
    tier: api.Tier
    image: criu.Image | None
    driver: cuda.DriverCheckpoint | None
    signals: pathlib.Path
    config: contract.WorkerConfig
    park_weights: bool
    park_driver_copy: bool
    parking: Parking
    driver_copy: dict[str, object]
    _paused: bool  # the worker waits in its pause hook since its restore into SUSPENDED
    _pinned_at_suspend: int  # pinned host memory it held at the driver's last checkpoint

    def _phase(self, name: str) -> contextlib.AbstractContextManager[None]: ...

    def _wait_for(self, pid: int, predicate: Callable[[], bool], what: str, timeout: float) -> None: ...

    def _gone_cold(self, detail: str) -> None: ...

    def _resume_worker(self, pid: int) -> None: ...

    def _sleep(self) -> None: ...

    def _pause(self, park: pathlib.Path | None = None) -> None: ...

    def _dump(self, generation: int, lazy_restorable: bool = True,
              abandoned: Callable[[], None] | None = None) -> None: ...

    def _publish(self, generation: int, parked: pathlib.Path | None) -> None: ...


class Freeze:
    """One freeze of a GPU worker (the instance's `gpu`) in the state of `generation`, phase by phase (the module
    docstring tells the sequence and its fallbacks)."""

    def __init__(self, inst: Frozen, generation: int) -> None:
        assert inst.driver is not None
        self.inst = inst
        self.driver = inst.driver
        self.generation = generation
        self.parked: pathlib.Path | None = None  # the file this freeze parked the weights in

    def from_hot(self) -> None:
        """Freeze a worker the driver has not checkpointed (HOT, or asleep with its context back)."""
        self.park()
        before = self.checkpoint()
        if self.parked is not None and before is not None:
            self.park_driver_copy(before)
        self.capture()

    def from_suspended(self) -> None:
        """Freeze a SUSPENDED worker: as it is when it was restored into SUSPENDED; through its context, back from
        the driver, where weights are parked; else with all it holds in the image."""
        inst = self.inst
        if inst._paused:
            assert inst.image is not None  # the one it was restored from
            inst._dump(self.generation, lazy_restorable=inst.image.lazy_restorable)
            inst._publish(self.generation, inst.parking.current)
            return
        if inst.park_weights and self.context_back():
            try:
                self.from_hot()
            except BaseException:
                self.suspend_again()
                raise
            return
        self.capture_all()

    # -- the phases ----------------------------------------------------------------------------------

    def park(self) -> None:
        """Pause the worker for its dump (requests that gateways just sent are handed back unrun, not reset), with
        a file to park its weights in where they are parked; `parked` is that file once the worker wrote it."""
        inst = self.inst
        park = inst.parking.new_file(self.generation, inst.config) if inst.park_weights else None
        inst._pause(park)
        self.parked = park if park is not None and park.exists() else None

    def checkpoint(self) -> regions.Presence | None:
        """Have the driver checkpoint the paused worker; the pages present before, to tell the driver's copy by
        (None where the copy is not parked, or /proc does not show them)."""
        inst = self.inst
        assert inst.pid is not None
        before = self._presence() if self.parked is not None and inst.park_driver_copy else None
        try:
            self.driver.suspend(inst.pid)
        except cuda.DriverCheckpointError:
            inst._resume_worker(inst.pid)  # the paused worker must serve again
            if self.parked is not None:
                self.parked.unlink(missing_ok=True)
            raise
        return before

    def _presence(self) -> regions.Presence | None:
        """The paused worker's pages before the driver's checkpoint, to tell the driver's copy after it (None, and
        the copy stays in the image, where /proc does not show them)."""
        assert self.inst.pid is not None
        try:
            return regions.presence(self.inst.pid)
        except OSError as exc:
            log.warning("%s: the driver's copy stays in the image: %s", self.inst.name, exc)
            return None

    def park_driver_copy(self, before: regions.Presence) -> None:
        """The driver has checkpointed the paused worker: name the pages its checkpoint filled (and what an earlier
        restore left mapped from parked files that are going) to the worker, which maps them from its parked file
        so that the image leaves them out (`worker.regions`). The pages are read while the worker idles in its
        pause, before it is told. A worker that cannot move them leaves them in the image (and says why); one
        that does not answer is not trusted any more."""
        inst, parked = self.inst, self.parked
        assert inst.pid is not None and inst.parking.folder is not None and parked is not None
        report_file = inst.signals / contract.DRIVER_COPY_PARKED
        report_file.unlink(missing_ok=True)
        try:
            moving, stale_bytes = to_park(inst.pid, before, parked)
        except OSError as exc:
            log.warning("%s: the driver's copy stays in the image: %s", inst.name, exc)
            return
        try:
            with inst._phase("park_driver_copy"):
                contract.publish(inst.signals, contract.DRIVER_CHECKPOINTED,
                                 json.dumps({"regions": [r.to_json() for r in moving]}))
                os.kill(inst.pid, contract.WAKE_SIGNAL)
                inst._wait_for(inst.pid, report_file.exists, "done with the driver's copy", 30.0)
        except process.WorkerStartError as exc:
            inst._gone_cold(str(exc))
            raise
        finally:
            (inst.signals / contract.DRIVER_CHECKPOINTED).unlink(missing_ok=True)
        inst.driver_copy = parked_report(report_file, stale_bytes)
        if "error" in inst.driver_copy:
            log.warning("%s: the driver's copy stays in the image: %s", inst.name, inst.driver_copy["error"])

    def capture(self) -> None:
        """Dump the checkpointed worker, keep the parked file its image maps (older ones go) and publish the image.
        An abandoned dump gives the worker its GPU state back before it serves again, and its parked file goes."""
        inst = self.inst
        try:
            inst._dump(self.generation, abandoned=self._give_back)
        except criu.CriuError:
            if self.parked is not None:
                self.parked.unlink(missing_ok=True)  # no image maps it; the worker's mapping outlives the name
            raise
        if self.parked is not None:
            inst.parking.drop(keep=self.parked)
        inst._publish(self.generation, self.parked)

    def _give_back(self) -> None:
        assert self.inst.pid is not None
        self.driver.resume(self.inst.pid)

    # -- from SUSPENDED ------------------------------------------------------------------------------

    def context_back(self) -> bool:
        """Restore the SUSPENDED worker's GPU state (its context; the weights, which it copied to pinned memory
        before the checkpoint, stay there unless `suspend_copies_weights` is off). False, and the image carries
        it all, when the driver cannot and the process is still checkpointed; a process in any other state is not
        trusted any more (COLD)."""
        inst = self.inst
        assert inst.pid is not None
        try:
            with inst._phase("driver"):
                self.driver.resume(inst.pid)
            return True
        except cuda.DriverCheckpointError as exc:
            try:
                state = self.driver.state(inst.pid)
            except cuda.DriverCheckpointError:
                state = None
            if state is not cuda.ProcessState.CHECKPOINTED:
                inst._gone_cold(f"the driver's restore before the freeze failed ({exc}); the process is {state}")
                raise
            log.warning("%s: the image carries the weights and the driver's copy: %s", inst.name, exc)
            return False

    def suspend_again(self) -> None:
        """After a freeze from SUSPENDED that failed once the driver had restored the worker: the worker,
        asleep and serving again, goes back to the driver's checkpoint (or COLD where it cannot)."""
        inst = self.inst
        if inst.pid is None or inst.tier != api.Tier.SUSPENDED:
            return  # the failure already took the worker (COLD)
        try:
            inst._sleep()
            self.driver.suspend(inst.pid)
        except (OSError, protocol.ProtocolError, protocol.WorkerError, cuda.DriverCheckpointError) as exc:
            inst._gone_cold(f"back to SUSPENDED after a failed freeze: {exc}")

    def capture_all(self) -> None:
        """Dump the checkpointed SUSPENDED worker with its weights and the driver's copy in the image (its parked
        files go). Restored lazily, a worker that held pinned memory at the driver's checkpoint failed the driver's
        restore (CUDA_ERROR_INVALID_VALUE, every time on an H200), and one restored eagerly did not."""
        inst = self.inst
        inst._pause()
        inst._dump(self.generation, lazy_restorable=inst._pinned_at_suspend <= 0)
        inst._publish(self.generation, None)
        inst.parking.drop()
