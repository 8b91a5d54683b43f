"""GPU discovery through NVML, and the node's hardware profile as annotations.

The agent calls `discover()` at start to learn which GPUs the node has, and publishes `hardware_profile()`
as `volga.dev/*` node annotations; the operator reads them back with `parse_hardware_profile()` to match a
ModelSpec's hardware (GPU product, minimum memory, NUMA affinity) to nodes. Annotation values are flat
strings so that they survive kubectl and any YAML tool untouched.

A node without the NVIDIA driver is a normal case (CPU nodes, CI), not an error: `discover()` returns an
empty list and logs at debug level. NVML reports a GPU's NUMA node only on recent drivers and some systems;
otherwise the kernel's `/sys/bus/pci/devices/<bus id>/numa_node` has it, and -1 means unknown.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from collections.abc import Iterable, Mapping

import pynvml

log = logging.getLogger(__name__)

ANNOTATION_PREFIX = "volga.dev/"
GPU_COUNT = ANNOTATION_PREFIX + "gpu-count"
GPU_PRODUCT = ANNOTATION_PREFIX + "gpu-product"
GPU_MEMORY_BYTES = ANNOTATION_PREFIX + "gpu-memory-bytes"
NUMA_NODES = ANNOTATION_PREFIX + "numa-nodes"


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


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    gpu_count: int
    gpu_product: str  # comma-separated when a node mixes products; "" without GPUs
    gpu_memory_bytes: int  # the smallest GPU's, so that a model fitting it fits on any GPU of the node
    numa_nodes: tuple[int, ...]  # sorted, known nodes only


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
        text = path.read_text().strip()
    except OSError:
        return ()
    cpus: list[int] = []
    for part in filter(None, text.split(",")):
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


def hardware_profile(gpus: Iterable[GpuInfo]) -> dict[str, str]:
    """Node annotations describing the GPUs for scheduling; the inverse is `parse_hardware_profile`."""
    gpus = list(gpus)
    return {
        GPU_COUNT: str(len(gpus)),
        GPU_PRODUCT: ",".join(sorted({gpu.product for gpu in gpus})),
        GPU_MEMORY_BYTES: str(min((gpu.memory_total_bytes for gpu in gpus), default=0)),
        NUMA_NODES: ",".join(str(node) for node in sorted({gpu.numa_node for gpu in gpus if gpu.numa_node >= 0})),
    }


def parse_hardware_profile(annotations: Mapping[str, str]) -> HardwareProfile | None:
    """The profile from a node's annotations; None when the node has none (no agent has published one).

    Other annotations are ignored. A partial or malformed profile raises ValueError naming the annotation.
    """
    if GPU_COUNT not in annotations:
        return None
    for key in (GPU_PRODUCT, GPU_MEMORY_BYTES, NUMA_NODES):
        if key not in annotations:
            raise ValueError(f"annotation {key}: missing (a hardware profile has {GPU_COUNT}, {GPU_PRODUCT}, "
                             f"{GPU_MEMORY_BYTES} and {NUMA_NODES})")
    numa = annotations[NUMA_NODES].strip()
    return HardwareProfile(
        gpu_count=_non_negative(GPU_COUNT, annotations[GPU_COUNT]),
        gpu_product=annotations[GPU_PRODUCT],
        gpu_memory_bytes=_non_negative(GPU_MEMORY_BYTES, annotations[GPU_MEMORY_BYTES]),
        numa_nodes=tuple(sorted({_non_negative(NUMA_NODES, part) for part in numa.split(",")})) if numa else (),
    )


def _non_negative(key: str, text: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise ValueError(f"annotation {key}: {text!r} is not an integer") from None
    if value < 0:
        raise ValueError(f"annotation {key}: must be >= 0, got {value}")
    return value
