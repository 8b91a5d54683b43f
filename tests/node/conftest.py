"""Real-node tests: a kubelet, containerd and kube-proxy on this machine (volga_bench.realnode), the chart installed
with helm from the images that `make images` builds, as a user installs Volga.

Every test collected in this folder carries the `node` marker: the folder is the kind, so a marker cannot drift."""

import pytest


def pytest_itemcollected(item: pytest.Item) -> None:
    item.add_marker(pytest.mark.node)
