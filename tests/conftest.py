from __future__ import annotations

import pathlib
import shutil
import tempfile
from collections.abc import Iterator

import pytest

try:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
except ImportError:  # tests/test_examples_gpu.py runs with torch, numpy and onnxruntime alone
    pass

from volga_agent import defaultmodel, local
from volga_agent.snapshot import criu
from volga_operator import api


@pytest.fixture(scope="session")
def default_spec() -> api.ModelSpecSpec:
    return defaultmodel.ensure().spec


@pytest.fixture
def rundir() -> Iterator[pathlib.Path]:
    # AF_UNIX paths are limited to 107 bytes: keep run folders short.
    with tempfile.TemporaryDirectory(prefix="vt-", dir="/tmp") as path:
        yield pathlib.Path(path)


@pytest.fixture
def criu_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[criu.CriuEngine]:
    root = pathlib.Path("/dev/shm") if pathlib.Path("/dev/shm").is_dir() else tmp_path_factory.getbasetemp()
    folder = pathlib.Path(tempfile.mkdtemp(prefix="volga-test-", dir=root))
    yield criu.CriuEngine(folder)
    shutil.rmtree(folder, ignore_errors=True)


# Clients of the gateway of a module's `up` fixture (a running `volga_agent.local.Embedded`).
@pytest.fixture
def g(up: local.Embedded) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(up.endpoints()["grpc"])
    yield client
    client.close()


@pytest.fixture
def h(up: local.Embedded) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(up.endpoints()["http"].removeprefix("http://"))
    yield client
    client.close()
