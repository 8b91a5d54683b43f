"""GPU tests: run on a lent GPU machine (`make test-gpu`); skipped where torch is missing.

Every test collected in this folder carries the `gpu` marker: the folder is the kind, so a marker cannot drift."""

import pytest


def pytest_itemcollected(item: pytest.Item) -> None:
    item.add_marker(pytest.mark.gpu)
