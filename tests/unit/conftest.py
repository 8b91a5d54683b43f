"""Unit tests: pure code, no process, binary or server. `make test-fast` runs this folder.

Every test collected in this folder carries the `unit` marker: the folder is the kind, so a marker cannot drift.
Nor can the kind itself: a test here that starts a process (subprocess, fork, spawn, exec; a worker, criu, helm,
a daemon) fails, even where the start was tried in a thread and its error swallowed there."""

from __future__ import annotations

import _posixsubprocess
import os
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

REFUSED = "a unit test starts no process: it belongs in tests/integration/"

# Every way Python starts a process: subprocess through its own name for _posixsubprocess.fork_exec (or through
# os.posix_spawn), multiprocessing through _posixsubprocess.fork_exec or os.fork, the rest through os.
STARTS = [(subprocess, "_fork_exec"), (_posixsubprocess, "fork_exec"), *((os, name) for name in (
    "fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "popen", "execv", "execve", "execl", "execle", "execlp",
    "execlpe", "execvp", "execvpe", "spawnv", "spawnve", "spawnvp", "spawnvpe"))]


class ProcessStarted(RuntimeError):
    pass


def pytest_itemcollected(item: pytest.Item) -> None:
    item.add_marker(pytest.mark.unit)


@pytest.fixture(autouse=True)
def starts_no_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    tried: list[str] = []

    def refuse(name: str) -> Callable[..., Any]:
        def start(*args: Any, **kwargs: Any) -> Any:
            what = f"{name}({_command(args)})"
            tried.append(what)
            raise ProcessStarted(f"{what}: {REFUSED}")
        return start

    for module, name in STARTS:
        if hasattr(module, name):
            monkeypatch.setattr(module, name, refuse(f"{module.__name__}.{name}"))
    yield
    if tried:
        pytest.fail(f"{REFUSED}; it tried " + ", ".join(tried), pytrace=False)


def _command(args: tuple[Any, ...]) -> str:
    """The program and its arguments where the call names them, shortened."""
    first = args[0] if args else ""
    if isinstance(first, list | tuple):
        first = " ".join(os.fsdecode(a) if isinstance(a, bytes) else str(a) for a in first)
    return repr(str(first)[:200])
