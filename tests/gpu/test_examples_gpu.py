"""The PyTorch and TorchScript examples as a user runs them: their ModelSpec files, unchanged, served by `volga
up`, answering over the Open Inference Protocol's REST API what the same module answers run directly in torch.

Needs torch (run on a GPU machine: `python3 -m pytest -m gpu tests/gpu/test_examples_gpu.py`); skipped without it.
Uses nothing but torch, numpy, onnxruntime and the repository: the requests are plain HTTP+JSON (urllib).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("examples")
    for example in ("pytorch", "torchscript"):
        shutil.copytree(EXAMPLES / example, root / example)
    spec = importlib.util.spec_from_file_location("volga_example_ts", root / "torchscript" / "make_model.py")
    assert spec is not None and spec.loader is not None
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    make.build(root / "torchscript" / "model.pt")
    return root


@pytest.fixture(scope="module")
def http(staged: pathlib.Path) -> Iterator[str]:
    """`volga up` serving both examples' ModelSpec files; its REST address."""
    cmd = [sys.executable, "-m", "volga_agent.cli", "up", "--http-port", "0", "--grpc-port", "0", "--metrics-port",
           "0", "--agent-port", "-1", "--allow-model-code", "-f", str(staged / "pytorch" / "modelspec.yaml"),
           "-f", str(staged / "torchscript" / "modelspec.yaml")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    seen = []
    address = ""
    try:
        for line in proc.stdout:
            seen.append(line)
            if match := re.match(r"\s+http\s+(\S+)", line):
                address = match.group(1)
            if line.strip().startswith("models"):
                break
        assert address, "volga up exited:\n" + "".join(seen)
        yield address
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)


def infer(http: str, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    body = {"inputs": [{"name": n, "shape": list(a.shape), "datatype": "FP32", "data": a.ravel().tolist()}
                       for n, a in inputs.items()]}
    request = urllib.request.Request(f"{http}/v2/models/{model}/infer", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    deadline = time.monotonic() + 300
    while True:  # the first request waits for the model's first start
        try:
            with urllib.request.urlopen(request, timeout=300) as reply:
                answer: dict[str, Any] = json.load(reply)
            break
        except urllib.error.HTTPError as exc:
            if exc.code != 503 or time.monotonic() > deadline:
                raise AssertionError(exc.read().decode()) from None
            time.sleep(1)
    return {o["name"]: np.asarray(o["data"], dtype=np.float32).reshape(o["shape"]) for o in answer["outputs"]}


def test_pytorch_example_from_model_py(staged: pathlib.Path, http: str) -> None:
    namespace: dict[str, Any] = {"__file__": str(staged / "pytorch" / "model.py"), "__name__": "example_model"}
    exec(compile((staged / "pytorch" / "model.py").read_text(), "model.py", "exec"), namespace)
    module = namespace["build_model"]().eval()
    image = np.random.default_rng(1).standard_normal((4, 1, 28, 28)).astype(np.float32)
    got = infer(http, "digits", {"image": image})
    with torch.inference_mode():
        want = {k: v.numpy() for k, v in module(torch.from_numpy(image)).items()}
    for name in ("logits", "probabilities"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["probabilities"].sum(axis=1), 1.0, rtol=1e-5)


def test_torchscript_example(staged: pathlib.Path, http: str) -> None:
    module = torch.jit.load(str(staged / "torchscript" / "model.pt")).eval()
    for length in (50, 73):
        sequence = np.random.default_rng(length).standard_normal((2, length, 16)).astype(np.float32)
        got = infer(http, "sequence-scorer", {"sequence": sequence})["scores"]
        with torch.inference_mode():
            want = module(torch.from_numpy(sequence)).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
