"""Processes as users start them, for end-to-end tests: started, waited for, stopped with SIGTERM."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from prometheus_client import parser as prometheus_parser

from volga_agent.host import process
from volga_agent.snapshot import criu


def wait_for(what: str, check: Callable[[], Any], timeout: float = 120.0, every: float = 0.25,
             proc: subprocess.Popen[Any] | None = None) -> Any:
    """Call `check` every `every` seconds until it returns something true, and return that. An exception raised
    (or returned) by `check` counts as not yet: the API server restarting, a process not listening yet; the last
    one is in the message when time runs out. With `proc`, that process exiting first ends the wait at once."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"exited ({proc.returncode}) before {what}")
        try:
            last = check()
        except Exception as exc:  # the API server restarting, a process not listening yet
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


class Daemon:
    """A volga process started as the DaemonSet would, its output in a log file."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], folder: pathlib.Path,
                 announce: str | None = None) -> None:
        self.log = folder / f"{name}.log"
        # faulthandler: a daemon that does not stop in time is sent SIGABRT first, which writes every thread's
        # stack into its log
        self.proc = subprocess.Popen(args, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", **env},
                                     start_new_session=True)
        self.line = ""
        if announce:
            self.line = wait_for(f"{name} to start", lambda: self._announced(announce), timeout=60)

    def _announced(self, prefix: str) -> str:
        if self.proc.poll() is not None:
            raise RuntimeError(f"exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
        return next((line for line in self.log.read_text().splitlines() if line.startswith(prefix)), "")

    def port(self, label: str) -> int:
        match = re.search(rf"{label} [\d.]+:(\d+)", self.line)
        assert match, self.line
        return int(match.group(1))

    def stop(self) -> int:
        """SIGTERM, and its exit code; one still running after 60 s gets SIGABRT (its threads' stacks go to the
        log: a hang to read, not to retry), then its whole session SIGKILL."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGABRT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=10)
                with contextlib.suppress(ProcessLookupError):  # the session may be gone with it
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode

    def tail(self) -> str:
        """The end of its log: the thread stacks of a daemon that did not stop in time are there."""
        return self.log.read_text()[-12000:]


def scrape(port: int, token: str | None = None) -> tuple[int, dict[str, str], str]:
    """GET /metrics on 127.0.0.1:port, with `Authorization: Bearer token` when given: status, headers, body."""
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, dict(reply.headers), reply.read().decode()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, dict(err.headers), err.read().decode()


def families(text: str) -> set[str]:
    """The metric family names of a /metrics page."""
    return {family.name for family in prometheus_parser.text_string_to_metric_families(text)}


def series(url: str, name: str) -> dict[str, float]:
    """Every sample of a metric: its labels as written -> its value."""
    out = {}
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        found = re.match(rf"{name}(\{{[^}}]*\}})? (\S+)$", line)
        if found:
            out[found.group(1) or ""] = float(found.group(2))
    return out


def tiers(agent: str, model: str) -> list[str]:
    """The tiers of a model's instances, as `volga status --agent AGENT --json` lists them."""
    out = subprocess.run([sys.executable, "-m", "volga_agent.cli", "status", "--agent", agent, "--json"],
                         capture_output=True, text=True, timeout=60, check=True)
    return [i["tier"] for m in json.loads(out.stdout)["models"] if m["modelId"] == model for i in m["instanceList"]]


def end_restored(child: subprocess.Popen[Any], restored: criu.Restored | None) -> None:
    """Kill a test's child process and the tree restored from its image (whose lazy-pages server then stops)."""
    if child.poll() is None:
        child.kill()
        child.wait()
    if restored is not None:
        process.kill(restored.pid)
        restored.stop()


@functools.cache
def huge_tmpfs_unavailable() -> str:
    """Why the tests cannot mount a tmpfs of huge pages here ("" when they can): tried once, on a scratch folder with
    mount(2) itself, apart from the code under test."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    folder = tempfile.mkdtemp(prefix="volga-probe-", dir="/dev/shm")
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        if libc.mount(b"tmpfs", folder.encode(), b"tmpfs", 0, b"huge=always") != 0:
            return f"a tmpfs of huge pages cannot be mounted here: {os.strerror(ctypes.get_errno())}"
        libc.umount2(folder.encode(), 0)
        return ""
    finally:
        os.rmdir(folder)
