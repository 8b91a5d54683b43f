"""`volga up` as a user runs it: a separate process, tritonclient against it, SIGTERM, nothing left over."""

from __future__ import annotations

import os
import pathlib
import signal
import time

import numpy as np
import pytest
import tritonclient.http as httpclient

from volga_agent.app import defaultmodel
from volga_agent.node import instance
from volga_agent.worker import contract
from volga_bench import harness

pytestmark = pytest.mark.slow


def descendants(pid: int) -> set[int]:
    found: set[int] = set()
    todo = [pid]
    while todo:
        current = todo.pop()
        for task in pathlib.Path(f"/proc/{current}/task").glob("*"):
            try:
                children = {int(c) for c in (task / "children").read_text().split()}
            except OSError:
                continue
            todo.extend(children - found)
            found |= children
    return found


def test_up_serves_and_stops_cleanly_on_sigterm(tmp_path: pathlib.Path) -> None:
    spec = defaultmodel.ensure().spec
    snapshots = tmp_path / "snapshots"
    with harness.volga_up(["--snapshot-dir", str(snapshots)]) as up:
        client = httpclient.InferenceServerClient(up.endpoints["http"].removeprefix("http://"))
        decls = instance.decls(spec.inputs)
        x = contract.sample_inputs(decls, batch=3, seed=4)
        inputs = harness.triton_inputs(decls, x, httpclient)
        out = client.infer(spec.model_id, inputs).as_numpy("probability")
        assert out.shape == (3, 1) and np.all((out > 0) & (out < 1))
        client.close()
        workers = descendants(up.proc.pid)
        assert workers, "the worker is a child of volga up (its subreaper)"
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=60) == 0
    assert "stopped." in "".join(up.output)
    time.sleep(0.2)
    assert not [pid for pid in workers if os.path.exists(f"/proc/{pid}")]
    assert not snapshots.exists() or not any(snapshots.iterdir())


def test_up_rejects_a_bad_spec_with_the_field(tmp_path: pathlib.Path) -> None:
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: volga.dev/v1alpha1\nkind: ModelSpec\nmetadata: {name: x}\n"
                   "spec: {modelId: x, framework: tensorflow, source: /m, inputs: [], outputs: []}\n")
    out = subprocess.run([sys.executable, "-m", "volga_agent.cli", "up", "-f", str(bad)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    assert "spec.framework" in out.stderr and "spec.inputs" in out.stderr
