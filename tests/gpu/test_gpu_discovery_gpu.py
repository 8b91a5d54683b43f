"""GPU discovery on a real GPU through NVML: every GPU found, with its PCI bus, NUMA node and the hardware profile.
Against a fake NVML: tests/unit/test_gpu_discovery.py."""

from __future__ import annotations

import pathlib

import pytest
from nvml_driver import nvml_loads

from volga_agent.host import gpus


def test_discover_on_a_real_gpu() -> None:
    if not nvml_loads():
        pytest.skip("no NVIDIA driver")
    found = gpus.discover()
    assert found, "NVML loads but discover() found no GPU"
    for index, info in enumerate(found):
        assert info.index == index
        assert info.uuid.startswith("GPU-") and info.product and info.driver
        assert 0 < info.memory_used_bytes < info.memory_total_bytes
        assert gpus.normalize_bus_id(info.pci_bus_id) == info.pci_bus_id
        assert pathlib.Path("/sys/bus/pci/devices", info.pci_bus_id).exists()
        assert info.numa_node >= -1
    assert gpus.node_profile(found, "n").gpu_count == len(found)
