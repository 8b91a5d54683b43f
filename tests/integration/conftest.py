"""Integration tests: real parts on this machine (CRIU, worker processes, the gateway with an unmodified
tritonclient, helm, promtool).

Every test collected in this folder carries the `integration` marker: the folder is the kind, so a marker cannot
drift."""

import pytest


def pytest_itemcollected(item: pytest.Item) -> None:
    item.add_marker(pytest.mark.integration)
