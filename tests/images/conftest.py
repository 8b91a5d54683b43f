"""Image tests: run the images `make images` builds (buildah, chroot).

Every test collected in this folder carries the `images` marker: the folder is the kind, so a marker cannot drift."""

import pytest


def pytest_itemcollected(item: pytest.Item) -> None:
    item.add_marker(pytest.mark.images)
