"""Kubernetes tests: a real kube-apiserver and etcd (kwok for fake nodes) built from the Go module proxy.

Every test collected in this folder carries the `k8s` marker: the folder is the kind, so a marker cannot drift."""

import pytest


def pytest_itemcollected(item: pytest.Item) -> None:
    item.add_marker(pytest.mark.k8s)
