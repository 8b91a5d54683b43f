"""Unit tests: pure code, no process, binary or server. `make test-fast` runs this folder.

Every test collected in this folder carries the `unit` marker: the folder is the kind, so a marker cannot drift."""

import pytest


def pytest_itemcollected(item: pytest.Item) -> None:
    item.add_marker(pytest.mark.unit)
