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


@pytest.mark.parametrize("hooks", ["level1", "none", "level2-parked", "level1-freeze2-parked"])
def test_llm_server_through_the_gpu_ladder(model_dir: pathlib.Path, engine: criu.CriuEngine, tmp_path: pathlib.Path,
                                           hooks: str) -> None:
    """With "-parked" the server runs through `python -m volga_agent.worker.handshake`: each freeze parks the driver's
    copy beside the image, and each FROZEN wake restores the tree lazily."""
    s = server.ServerInstance(llmserver.spec(model_dir, 2048, hooks), tmp_path, engine, driver=cuda.DriverCheckpoint())
    parks = hooks.endswith("-parked")

    def parked_as_told() -> None:
        assert s.copies_parked is parks, s.driver_copies
        assert (s.parking.size > 0) is parks

    try:
        s.start()
        before = s.call("POST", "/v1/completions", BODY)
        assert before.status == 200
        steps = ([s.warm] if hooks != "none" else []) + [s.suspend, s.freeze]
        for step in steps:
            step()
            assert s.tier is not Tier.HOT
            if s.gpu_pids or s.tier is Tier.FROZEN:  # its one context's stack lowered before the driver's checkpoint
                trims = list(s.stack_trims.values())
                assert [t.get("contexts") for t in trims] == ([1] if parks else []), trims
            if s.tier is Tier.FROZEN:
                parked_as_told()
            with s.serving():
                assert s.call("POST", "/v1/completions", BODY) == before
            assert not s.transitions[-1].fallback, s.transitions[-1].detail
        assert s.restored_lazily is parks
        s.suspend()
        assert s.gpu_pids and s.tier is Tier.SUSPENDED
        s.freeze()  # from SUSPENDED: the image holds the checkpointed context
        parked_as_told()
        with s.serving():
            assert s.call("POST", "/v1/completions", BODY) == before
        wake = s.transitions[-1]
        assert (wake.source, wake.fallback) == (Tier.FROZEN, False) and {"restore", "driver"} <= set(wake.phases)
        assert not s.gpu_pids and not s.slept and s.restored_lazily is parks
        if hooks.startswith("level1-freeze2"):  # SUSPENDED at level 1; woken and set to sleep at level 2 for the image
            assert json.loads(s.call("GET", "/stats").body)["sleep_level"] == 2
    finally:
        s.close()


def test_volga_up_wakes_the_llm_server_from_its_suspended_floor(model_dir: pathlib.Path,
                                                                 tmp_path: pathlib.Path) -> None:
    """`volga up` runs a server ModelSpec on the GPU as a cluster node's agent does (the server pool, the node's
    driver): brought to its SUSPENDED floor (`pool: {suspended: 1, frozen: 0}`), woken by a request through the
    gateway with its answer streamed, HOT answering the same, and back at its floor once idle, woken again alike."""
    import urllib.request

    import yaml
    from procs import series, tiers, wait_for

    from volga_bench import harness

    wire = llmserver.spec(model_dir, 2048, "level2").to_wire()
    wire["pool"] = {"suspended": 1, "frozen": 0}
    doc = {"apiVersion": api.API_VERSION, "kind": "ModelSpec", "metadata": {"name": "llm"}, "spec": wire}
    (tmp_path / "llm.yaml").write_text(yaml.safe_dump(doc))
    body = json.dumps({**json.loads(BODY), "stream": True}).encode()

    def ask(up: harness.UpProcess) -> bytes:
        request = urllib.request.Request(up.endpoints["http"] + "/v1/completions", data=body, method="POST",
                                         headers={"x-model-id": "llm", "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            return r.read()

    with harness.volga_up(["-f", str(tmp_path / "llm.yaml"), "--model-root", str(model_dir), "--idle-sec", "3"],
                          timeout=600) as up:
        def suspended() -> bool:
            return tiers(up.endpoints["agent"], "llm") == ["SUSPENDED"]

        wait_for("the server at its SUSPENDED floor", suspended, timeout=600, every=1)
        woken = ask(up)
        assert woken.count(b"data: ") == 9 and woken == ask(up)  # 8 tokens and [DONE]; HOT answers the same
        wait_for("the idle server back at its floor", suspended, timeout=120, every=1)
        assert ask(up) == woken
        wakes = series(up.endpoints["metrics"], "volga_activations_total")
        assert wakes.get('{model="llm",tier="SUSPENDED"}') == 2.0, wakes
        assert not series(up.endpoints["metrics"], "volga_snapshot_restore_failures_total"), "a wake fell back"
