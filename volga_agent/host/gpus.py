"""GPU discovery through NVML, and the node's hardware profile.

The agent calls `discover()` at start to learn which GPUs the node has, and publishes `node_profile()` as
`volga.dev/*` node annotations (`nodes.NodeProfile.annotations()`); the operator reads them back with
`nodes.NodeProfile.from_annotations()` to match a ModelSpec's hardware (GPU product, minimum memory, NUMA
affinity) to nodes.

A node without the NVIDIA driver is a normal case (CPU nodes, CI), not an error: `discover()` returns an
empty list and logs at debug level. NVML reports a GPU's NUMA node only on recent drivers and some systems;
otherwise the kernel's `/sys/bus/pci/devices/<bus id>/numa_node` has it, and -1 means unknown.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from collections.abc import Sequence

import pynvml

from volga_core import nodes

log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    product: str
    memory_total_bytes: int
    memory_used_bytes: int
    driver: str
    pci_bus_id: str  # Linux form, as under /sys/bus/pci/devices: "0000:17:00.0"
    numa_node: int  # -1: unknown


def normalize_bus_id(bus_id: str | bytes) -> str:
    """NVML's "00000000:17:00.0" -> the kernel's "0000:17:00.0" (lower case, domain as 4 hex digits)."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    parts = text.strip().strip("\x00").lower().split(":")
    if len(parts) != 3 or "." not in parts[2]:
        raise ValueError(f"not a PCI bus id (domain:bus:device.function): {text!r}")
    domain, bus, slot = parts
    device, function = slot.split(".", 1)
    try:
        return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}.{int(function, 16):x}"
    except ValueError:
        raise ValueError(f"not a PCI bus id (domain:bus:device.function): {text!r}") from None


def sysfs_numa_node(bus_id: str, sysfs_root: str | pathlib.Path = "/sys") -> int:
    """The NUMA node the kernel reports for a PCI device, or -1 when it does not know."""
    path = pathlib.Path(sysfs_root) / "bus" / "pci" / "devices" / normalize_bus_id(bus_id) / "numa_node"
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return -1


def numa_cpus(node: int, sysfs_root: str | pathlib.Path = "/sys") -> tuple[int, ...]:
    """The CPUs of a NUMA node (its sysfs cpulist, e.g. "0-15,32-47"); () when unknown."""
    if node < 0:
        return ()
    path = pathlib.Path(sysfs_root) / "devices" / "system" / "node" / f"node{node}" / "cpulist"
    try:
        return cpu_list(path.read_text())
    except OSError:
        return ()


def cpu_list(text: str) -> tuple[int, ...]:
    """The CPUs of a Linux CPU list such as "0-15,32-47" (sysfs, taskset -c); ValueError when it is none."""
    cpus: list[int] = []
    for part in filter(None, text.strip().split(",")):
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return tuple(cpus)


def _text(value: str | bytes) -> str:
    # Older pynvml releases return bytes; struct fields such as busId are bytes in all of them.
    return value.decode() if isinstance(value, bytes) else str(value)


def _numa_node(handle: object, bus_id: str, sysfs_root: str | pathlib.Path) -> int:
    try:
        node = int(pynvml.nvmlDeviceGetNumaNodeId(handle))
    except (pynvml.NVMLError, AttributeError) as exc:  # "Not Supported", or a pynvml without the call
        log.debug("NVML has no NUMA node for %s (%s); reading sysfs", bus_id, exc)
    else:
        if node >= 0:
            return node
    return sysfs_numa_node(bus_id, sysfs_root)


def _device(index: int, driver: str, sysfs_root: str | pathlib.Path) -> GpuInfo:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    bus_id = normalize_bus_id(_text(pynvml.nvmlDeviceGetPciInfo(handle).busId))
    return GpuInfo(
        index=index,
        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
        product=_text(pynvml.nvmlDeviceGetName(handle)),
        memory_total_bytes=int(memory.total),
        memory_used_bytes=int(memory.used),
        driver=driver,
        pci_bus_id=bus_id,
        numa_node=_numa_node(handle, bus_id, sysfs_root),
    )


def discover(sysfs_root: str | pathlib.Path = "/sys") -> list[GpuInfo]:
    """The node's NVIDIA GPUs in NVML index order; [] without a driver. Never raises for a missing driver."""
    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError, OSError) as exc:
        log.debug("no NVIDIA GPUs: NVML unavailable (%s)", exc)
        return []
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        count = int(pynvml.nvmlDeviceGetCount())
        gpus = []
        for index in range(count):
            try:
                gpus.append(_device(index, driver, sysfs_root))
            except (pynvml.NVMLError, ValueError) as exc:
                # A lost or broken GPU must not hide the healthy ones; it is worth a warning on a GPU node.
                log.warning("skipping GPU %d: %s", index, exc)
        return gpus
    except pynvml.NVMLError as exc:
        log.debug("no NVIDIA GPUs: NVML query failed (%s)", exc)
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.debug("nvmlShutdown failed: %s", exc)


def process_memory_bytes(index: int, pid: int) -> int | None:
    """Device memory process `pid` holds on GPU `index` (NVML's compute processes), 0 when it holds none;
    None without NVML or where the driver does not say (NVML reports no usage inside some containers)."""
    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError, OSError):
        return None
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if int(proc.pid) == pid:
                used = proc.usedGpuMemory
                return None if used is None else int(used)
        return 0
    except pynvml.NVMLError as exc:
        log.debug("NVML has no per-process memory for GPU %d: %s", index, exc)
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.debug("nvmlShutdown failed: %s", exc)


def kind_of(device: str, found: Sequence[GpuInfo]) -> str:
    """What a device is, as calibrations and device hints name it: "cpu", or the product of the GPU `device`
    ("cuda:N") names among `found` (the device itself when it is not among them)."""
    if not device.startswith("cuda"):
        return "cpu"
    index = int(device.partition(":")[2] or 0)
    return next((g.product for g in found if g.index == index and g.product), device)


def node_profile(found: Sequence[GpuInfo], name: str) -> nodes.NodeProfile:
    """The node as the planner sees it: products comma-separated when a node mixes them; the smallest GPU's
    memory, so that a model fitting it fits on any GPU of the node; the known NUMA nodes."""
    return nodes.NodeProfile(name, len(found), ",".join(sorted({g.product for g in found})),
                               min((g.memory_total_bytes for g in found), default=0),
                               tuple(sorted({g.numa_node for g in found if g.numa_node >= 0})))
