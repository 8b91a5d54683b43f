"""What several bench scripts share: a file mapped afresh, the JSON report printed and written (`--out`), and a -v4
criu log read into its timeline. Imported from beside them (`import benchio`), as the scripts run standalone:
python3 bench/NAME.py."""

from __future__ import annotations

import itertools
import json
import mmap
import os
import pathlib
import re
from typing import Any


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


CRIU_STAMP = re.compile(r"^\((\d+)\.(\d+)\) (.*)$")  # a -v4 criu log line: seconds.microseconds since its start
_VMAS = re.compile(r"Found (\d+) VMAs in image")  # a restore's -v4 log, per process


def criu_log(log: pathlib.Path, gaps: int = 0) -> dict[str, Any]:
    """How long a -v4 criu log spans, and its `gaps` largest steps between consecutive lines (ms, the line after);
    for a restore's log also when the tree was rebuilt ("Unlock network", ms from the first line) and how long criu
    then waited for the restored threads' last stop (from the last thread's seccomp line to the first "was
    trapped": docs/snapshots.md, criu's last stop), and how many mappings it restored (`vmas`)."""
    stamps: list[tuple[float, str]] = []
    for line in log.read_text(errors="replace").splitlines():
        m = CRIU_STAMP.match(line)
        if m:
            stamps.append((int(m.group(1)) + int(m.group(2)) / 1e6, m.group(3)[:160]))
    steps = sorted(((b[0] - a[0], b[1]) for a, b in itertools.pairwise(stamps)), reverse=True)[:gaps]
    out: dict[str, Any] = {"lines": len(stamps),
                           "span_ms": round((stamps[-1][0] - stamps[0][0]) * 1e3, 2) if stamps else None,
                           "largest_gaps": [[round(ms * 1e3, 2), text] for ms, text in steps]}
    vmas = [int(m.group(1)) for _, text in stamps if (m := _VMAS.search(text))]
    if vmas:
        out["vmas"] = sum(vmas)  # the mappings of every process restored
    unlock = next((at for at, text in stamps if "Unlock network" in text), None)
    last_steps = [at for at, text in stamps if "seccomp: mode" in text]
    stops = [at for at, text in stamps if text.endswith("was trapped")]
    if unlock is not None and stamps:
        out["unlock_ms"] = round((unlock - stamps[0][0]) * 1e3, 2)
    if last_steps and stops:
        out["last_stop_wait_ms"] = round((min(stops) - max(last_steps)) * 1e3, 2)
    return out
