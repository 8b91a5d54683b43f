"""What several bench scripts share: a file mapped afresh, and the JSON report printed and written (`--out`).
Imported from beside them (`import benchio`), as the scripts run standalone: python3 bench/NAME.py."""

from __future__ import annotations

import json
import mmap
import os
import pathlib


def fresh(path: pathlib.Path, nbytes: int) -> mmap.mmap:
    """A new shared mapping of the file, with no page tables yet (as a restored worker's)."""
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
    finally:
        os.close(fd)


def emit(report: object, out: str | None) -> None:
    """The report as indented JSON: written to `out` when given, and printed."""
    text = json.dumps(report, indent=1)
    if out:
        pathlib.Path(out).write_text(text)
    print(text)
