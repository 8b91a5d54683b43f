"""How the demo and the benches run Volga and talk to it: its parts embedded in this process on ephemeral ports
(`start_embedded`), or `volga up` as a separate process, as a user runs it (`volga_up`); and the tritonclient
inputs for a model's tensors (`triton_inputs`). The tests use them too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import numpy as np
import tritonclient.grpc as grpcclient

from volga_agent.app import up
from volga_agent.worker import contract
from volga_core import api

T = TypeVar("T")


class Background:
    """An asyncio loop on a thread, for driving the embedded server from synchronous client code."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="volga-up", daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.loop.close()


def start_embedded(specs: list[api.ModelSpec], **options: Any) -> tuple[Background, up.Embedded]:
    """Start `volga up`'s parts on ephemeral ports in a background loop."""
    defaults: dict[str, Any] = {"http_port": 0, "grpc_port": 0, "metrics_port": 0, "agent_port": 0}
    bg = Background()
    embedded = bg.call(_make(specs, up.Options(**{**defaults, **options})))
    bg.call(embedded.start())
    return bg, embedded


async def _make(specs: list[api.ModelSpec], options: up.Options) -> up.Embedded:
    return up.Embedded(specs, options)


def triton_inputs(decls: tuple[contract.TensorDecl, ...], arrays: dict[str, np.ndarray],
                  client_module: Any = grpcclient) -> list[Any]:
    """tritonclient InferInputs for the arrays (`client_module`: tritonclient.grpc (default) or .http)."""
    out = []
    for decl in decls:
        item = client_module.InferInput(decl.name, list(arrays[decl.name].shape), decl.dtype)
        item.set_data_from_numpy(arrays[decl.name])
        out.append(item)
    return out


@dataclasses.dataclass
class UpProcess:
    proc: subprocess.Popen[str]
    endpoints: dict[str, str]
    output: list[str]


@contextlib.contextmanager
def volga_up(extra: list[str] | None = None, timeout: float = 180.0, cpus: tuple[int, ...] = ()
             ) -> Iterator[UpProcess]:
    """Run `volga up` on ephemeral ports until it announces its endpoints; stop it with SIGTERM afterwards. With
    `cpus`, it runs on those CPUs only, its workers too (they inherit its affinity). Its output is read all along
    (into `output`), so that a talkative run never blocks on a full pipe."""
    cmd = [sys.executable, "-m", "volga_agent.cli", "up", "--http-port", "0", "--grpc-port", "0",
           "--metrics-port", "0", "--agent-port", "0", *(extra or [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if cpus:
        os.sched_setaffinity(proc.pid, cpus)  # before it starts a thread or a worker, which inherit it
    up = UpProcess(proc, {}, [])
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            up.output.append(line)
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=read, name="volga-up-output", daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + timeout
        while "agent" not in up.endpoints or "models" not in up.endpoints:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError("volga up did not announce its endpoints:\n" + "".join(up.output[-20:])) from None
            if line is None:
                raise RuntimeError("volga up exited:\n" + "".join(up.output[-20:]))
            match = re.match(r"\s+(\w+)\s+(\S+)", line)
            if match:
                up.endpoints[match.group(1)] = match.group(2)
        yield up
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)
