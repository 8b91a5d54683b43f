from __future__ import annotations

import pathlib
import shutil
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from volga_agent.app import defaultmodel
from volga_agent.node import instance
from volga_agent.snapshot import criu
from volga_core import api

if TYPE_CHECKING:  # the GPU machine runs its tests without the gateway's clients
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    from volga_agent.app import up as volga_up


# The helper modules beside this file assert too: pytest rewrites their asserts as it does the tests' (registered
# here, before any test module imports them).
pytest.register_assert_rewrite("autonomy_stubs", "chart", "images", "neighbour_levels", "nvml_driver", "pools", "procs",
                               "shared_workers", "silero_specs", "specs", "traffic")


@pytest.fixture(scope="session")
def default_spec() -> api.ModelSpecSpec:
    return defaultmodel.ensure().spec


@pytest.fixture
def rundir() -> Iterator[pathlib.Path]:
    # AF_UNIX paths are limited to 107 bytes: keep run folders short.
    with tempfile.TemporaryDirectory(prefix="vt-", dir="/tmp") as path:
        yield pathlib.Path(path)


@pytest.fixture
def models(tmp_path: pathlib.Path, default_spec: api.ModelSpecSpec) -> pathlib.Path:
    """A model root (settings.model_roots) holding the default model as m.onnx."""
    root = tmp_path / "models"
    root.mkdir()
    shutil.copy(default_spec.source_path, root / "m.onnx")
    return root


@pytest.fixture
def hot(default_spec: api.ModelSpecSpec, rundir: pathlib.Path) -> Iterator[instance.Instance]:
    """A worker of the default model, HOT, without snapshots."""
    inst = instance.Instance("w", default_spec, rundir, None)
    inst.to(api.Tier.HOT)
    yield inst
    inst.close()
    assert inst.pid is None


@pytest.fixture
def criu_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[criu.CriuEngine]:
    root = pathlib.Path("/dev/shm") if pathlib.Path("/dev/shm").is_dir() else tmp_path_factory.getbasetemp()
    folder = pathlib.Path(tempfile.mkdtemp(prefix="volga-test-", dir=root))
    yield criu.CriuEngine(folder)
    shutil.rmtree(folder, ignore_errors=True)


# Clients of the gateway of a module's `up` fixture (a running `volga_agent.app.up.Embedded`).
@pytest.fixture
def g(up: volga_up.Embedded) -> Iterator[grpcclient.InferenceServerClient]:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(up.endpoints()["grpc"])
    yield client
    client.close()


@pytest.fixture
def h(up: volga_up.Embedded) -> Iterator[httpclient.InferenceServerClient]:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(up.endpoints()["http"].removeprefix("http://"))
    yield client
    client.close()
