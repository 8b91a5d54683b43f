"""GPU discovery against a fake NVML, sysfs NUMA lookup, and the hardware profile annotations."""

from __future__ import annotations

import logging
import pathlib
import types
from collections.abc import Callable

import pynvml
import pytest
from nvml_driver import nvml_loads

from volga_agent.host import gpus
from volga_core import nodes

GiB = 1 << 30


class FakeNVMLError(Exception):
    pass


class FakeNotSupported(FakeNVMLError):
    def __str__(self) -> str:
        return "Not Supported"


def fake_nvml(devices: list[dict[str, object]], *, numa: Callable[[int], int] | None = None,
              init_error: Exception | None = None, broken: frozenset[int] = frozenset()) -> types.SimpleNamespace:
    """A stand-in for the pynvml module; handles are device indexes. Records init/shutdown calls."""
    calls: list[str] = []

    def init() -> None:
        calls.append("init")
        if init_error is not None:
            raise init_error

    def handle(index: int) -> int:
        if index in broken:
            raise FakeNVMLError("GPU is lost")
        return index

    def numa_node(index: int) -> int:
        if numa is None:
            raise FakeNotSupported()
        return numa(index)

    return types.SimpleNamespace(
        NVMLError=FakeNVMLError,
        calls=calls,
        nvmlInit=init,
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlSystemGetDriverVersion=lambda: "580.95.05",
        nvmlDeviceGetCount=lambda: len(devices),
        nvmlDeviceGetHandleByIndex=handle,
        nvmlDeviceGetUUID=lambda i: devices[i]["uuid"],
        nvmlDeviceGetName=lambda i: devices[i]["name"],
        nvmlDeviceGetMemoryInfo=lambda i: types.SimpleNamespace(total=devices[i]["total"], used=devices[i]["used"]),
        # NVML's struct field is bytes, with the 8-digit domain.
        nvmlDeviceGetPciInfo=lambda i: types.SimpleNamespace(busId=devices[i]["bus"]),
        nvmlDeviceGetNumaNodeId=numa_node,
    )


DEVICES: list[dict[str, object]] = [
    {"uuid": "GPU-aaaa", "name": "NVIDIA H200", "total": 141 * GiB, "used": GiB, "bus": b"00000000:17:00.0"},
    {"uuid": "GPU-bbbb", "name": b"NVIDIA H200", "total": 140 * GiB, "used": 0, "bus": b"00000000:9A:00.0"},
]


def write_sysfs(root: pathlib.Path, bus_id: str, content: str) -> None:
    folder = root / "bus" / "pci" / "devices" / bus_id
    folder.mkdir(parents=True)
    (folder / "numa_node").write_text(content)


def test_discover_without_a_driver_returns_empty(caplog: pytest.LogCaptureFixture) -> None:
    if nvml_loads():
        pytest.skip("this machine has an NVIDIA driver")
    with caplog.at_level(logging.DEBUG, logger="volga_agent.host.gpus"):
        assert gpus.discover() == []
    assert any("NVML unavailable" in record.message and record.levelno == logging.DEBUG
               for record in caplog.records)


def test_discover_swallows_library_not_found(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = fake_nvml(DEVICES, init_error=pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    fake.NVMLError = pynvml.NVMLError
    monkeypatch.setattr(gpus, "pynvml", fake)
    assert gpus.discover() == []
    assert fake.calls == ["init"]  # nothing to shut down


def test_discover_swallows_os_error_from_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpus, "pynvml", fake_nvml(DEVICES, init_error=OSError("libnvidia-ml.so.1: not found")))
    assert gpus.discover() == []


@pytest.mark.parametrize(("nvml", "expected"), [
    ("00000000:17:00.0", "0000:17:00.0"),
    (b"00000000:9A:00.0\x00", "0000:9a:00.0"),
    ("0000:3b:00.1", "0000:3b:00.1"),
    ("00010000:01:00.0", "10000:01:00.0"),  # domains above 0xffff keep all their digits, as the kernel prints them
])
def test_normalize_bus_id(nvml: str | bytes, expected: str) -> None:
    assert gpus.normalize_bus_id(nvml) == expected


@pytest.mark.parametrize("bad", ["", "17:00.0", "0000:zz:00.0", "0000:17:00"])
def test_normalize_bus_id_rejects_garbage(bad: str) -> None:
    with pytest.raises(ValueError, match="not a PCI bus id"):
        gpus.normalize_bus_id(bad)


def test_sysfs_numa_node(tmp_path: pathlib.Path) -> None:
    write_sysfs(tmp_path, "0000:9a:00.0", "1\n")
    write_sysfs(tmp_path, "0000:17:00.0", "-1\n")
    write_sysfs(tmp_path, "0000:18:00.0", "garbage\n")
    assert gpus.sysfs_numa_node("00000000:9A:00.0", tmp_path) == 1
    assert gpus.sysfs_numa_node("00000000:17:00.0", tmp_path) == -1
    assert gpus.sysfs_numa_node("00000000:18:00.0", tmp_path) == -1
    assert gpus.sysfs_numa_node("00000000:19:00.0", tmp_path) == -1  # no such device


def test_discover_maps_nvml_fields(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    fake = fake_nvml(DEVICES, numa=lambda index: index)
    monkeypatch.setattr(gpus, "pynvml", fake)
    assert gpus.discover(sysfs_root=tmp_path) == [
        gpus.GpuInfo(index=0, uuid="GPU-aaaa", product="NVIDIA H200", memory_total_bytes=141 * GiB,
                     memory_used_bytes=GiB, driver="580.95.05", pci_bus_id="0000:17:00.0", numa_node=0),
        gpus.GpuInfo(index=1, uuid="GPU-bbbb", product="NVIDIA H200", memory_total_bytes=140 * GiB,
                     memory_used_bytes=0, driver="580.95.05", pci_bus_id="0000:9a:00.0", numa_node=1),
    ]
    assert fake.calls == ["init", "shutdown"]


def test_discover_reads_sysfs_when_nvml_numa_is_not_supported(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: pathlib.Path) -> None:
    monkeypatch.setattr(gpus, "pynvml", fake_nvml(DEVICES, numa=None))
    write_sysfs(tmp_path, "0000:9a:00.0", "1\n")  # nothing for 0000:17:00.0: unknown
    assert [gpu.numa_node for gpu in gpus.discover(sysfs_root=tmp_path)] == [-1, 1]


def test_discover_reads_sysfs_when_nvml_reports_no_node(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: pathlib.Path) -> None:
    monkeypatch.setattr(gpus, "pynvml", fake_nvml(DEVICES, numa=lambda index: -1))
    write_sysfs(tmp_path, "0000:17:00.0", "0\n")
    assert [gpu.numa_node for gpu in gpus.discover(sysfs_root=tmp_path)] == [0, -1]


def test_discover_copes_with_a_pynvml_without_the_numa_call(monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: pathlib.Path) -> None:
    fake = fake_nvml(DEVICES)
    del fake.nvmlDeviceGetNumaNodeId
    monkeypatch.setattr(gpus, "pynvml", fake)
    write_sysfs(tmp_path, "0000:17:00.0", "0\n")
    assert [gpu.numa_node for gpu in gpus.discover(sysfs_root=tmp_path)] == [0, -1]


def test_discover_skips_a_broken_gpu_and_keeps_the_rest(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    fake = fake_nvml(DEVICES, numa=lambda index: 0, broken=frozenset({0}))
    monkeypatch.setattr(gpus, "pynvml", fake)
    with caplog.at_level(logging.WARNING, logger="volga_agent.host.gpus"):
        found = gpus.discover(sysfs_root=tmp_path)
    assert [gpu.index for gpu in found] == [1]
    assert "skipping GPU 0: GPU is lost" in caplog.text
    assert fake.calls == ["init", "shutdown"]


def test_discover_returns_empty_when_a_node_wide_query_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = fake_nvml(DEVICES)

    def count() -> int:
        raise FakeNVMLError("Driver Not Loaded")

    fake.nvmlDeviceGetCount = count
    monkeypatch.setattr(gpus, "pynvml", fake)
    assert gpus.discover() == []
    assert fake.calls == ["init", "shutdown"]


def gpu(index: int, product: str = "NVIDIA H200", memory: int = 141 * GiB, numa: int = 0) -> gpus.GpuInfo:
    return gpus.GpuInfo(index=index, uuid=f"GPU-{index}", product=product, memory_total_bytes=memory,
                        memory_used_bytes=0, driver="580.95.05", pci_bus_id=f"0000:{index + 16:02x}:00.0",
                        numa_node=numa)


def test_node_profile_annotations() -> None:
    node = [gpu(0, numa=1), gpu(1, memory=80 * GiB, numa=0), gpu(2, numa=1), gpu(3, numa=-1)]
    assert gpus.node_profile(node, "n1").annotations() == {
        "volga.dev/gpu-count": "4",
        "volga.dev/gpu-product": "NVIDIA H200",
        "volga.dev/gpu-memory-bytes": str(80 * GiB),
        "volga.dev/numa-nodes": "0,1",
    }


@pytest.mark.parametrize("node", [
    [],
    [gpu(0)],
    [gpu(0, numa=1), gpu(1, memory=80 * GiB, numa=0)],
    [gpu(0, product="NVIDIA H200"), gpu(1, product="NVIDIA A100-SXM4-80GB", numa=-1)],
])
def test_node_profile_round_trip(node: list[gpus.GpuInfo]) -> None:
    """What the agent publishes is what the operator's planner reads back."""
    annotations = {"kubernetes.io/hostname": "n1", **gpus.node_profile(node, "n1").annotations()}
    assert nodes.NodeProfile.from_annotations("n1", annotations) == nodes.NodeProfile(
        "n1",
        gpu_count=len(node),
        gpu_product=",".join(sorted({g.product for g in node})),
        gpu_memory_bytes=min((g.memory_total_bytes for g in node), default=0),
        numa_nodes=tuple(sorted({g.numa_node for g in node if g.numa_node >= 0})),
    )


def test_numa_cpus_reads_the_cpulist(tmp_path: pathlib.Path) -> None:
    node = tmp_path / "devices" / "system" / "node" / "node1"
    node.mkdir(parents=True)
    (node / "cpulist").write_text("0-3,8-9,12\n")
    assert gpus.numa_cpus(1, tmp_path) == (0, 1, 2, 3, 8, 9, 12)
    assert gpus.numa_cpus(0, tmp_path) == ()
    assert gpus.numa_cpus(-1, tmp_path) == ()


def test_cpu_lists_parse_as_taskset_and_sysfs_write_them() -> None:
    assert gpus.cpu_list("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert gpus.cpu_list("5") == (5,)
    with pytest.raises(ValueError):
        gpus.cpu_list("two")
