"""A model server on the GPU (`framework: server`): the LLM server of `volga bench server --gpu` (1.17B parameters,
a KV cache, streaming; it knows nothing of Volga) through WARM, SUSPENDED and FROZEN with vLLM-style sleep hooks,
every answer compared with its answer before. Run on the GPU machine with `make test-gpu`."""

from __future__ import annotations

import json
import pathlib
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from volga_agent.node import server
from volga_agent.snapshot import criu, cuda
from volga_bench import llmserver
from volga_core import api

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

Tier = api.Tier
BODY = json.dumps({"prompt": "tiers", "max_tokens": 8}).encode()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from volga_bench.servers import llm_model

    return llm_model.make_model(tmp_path_factory.mktemp("llm"))


@pytest.fixture
def engine() -> Iterator[criu.CriuEngine]:
    folder = pathlib.Path(tempfile.mkdtemp(prefix="volga-gpu-servers-", dir="/dev/shm"))
    yield criu.CriuEngine(folder, criu=criu.find_criu())
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("hooks", ["level1", "none"])
def test_llm_server_through_the_gpu_ladder(model_dir: pathlib.Path, engine: criu.CriuEngine, tmp_path: pathlib.Path,
                                           hooks: str) -> None:
    s = server.ServerInstance(llmserver.spec(model_dir, 2048, hooks), tmp_path, engine, driver=cuda.DriverCheckpoint())
    try:
        s.start()
        before = s.call("POST", "/v1/completions", BODY)
        assert before.status == 200
        steps = ([s.warm] if hooks != "none" else []) + [s.suspend, s.freeze]
        for step in steps:
            step()
            assert s.tier is not Tier.HOT
            with s.serving():
                assert s.call("POST", "/v1/completions", BODY) == before
            assert not s.transitions[-1].fallback, s.transitions[-1].detail
        s.suspend()
        assert s.gpu_pids and s.tier is Tier.SUSPENDED
        s.freeze()  # from SUSPENDED: the image holds the checkpointed context
        with s.serving():
            assert s.call("POST", "/v1/completions", BODY) == before
        wake = s.transitions[-1]
        assert (wake.source, wake.fallback) == (Tier.FROZEN, False) and {"restore", "driver"} <= set(wake.phases)
        assert not s.gpu_pids and not s.slept
    finally:
        s.close()
