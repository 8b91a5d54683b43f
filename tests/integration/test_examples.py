"""The examples under examples/ as a user runs them: their ModelSpec files, unchanged, served by one `volga up`,
their client code against its gateway (tritonclient), each answer equal to the same client code run on
onnxruntime directly. The model files come from the pip packages that ship them (examples/models.py)."""

from __future__ import annotations

import importlib.util
import pathlib
import shutil
import sys
from collections.abc import Callable, Iterator
from types import ModuleType

import numpy as np
import onnxruntime as ort
import pytest

from volga_bench import harness

pytestmark = pytest.mark.slow
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
ONNX_EXAMPLES = ("vision", "streaming-vad", "fp16", "pipeline")


def load(path: pathlib.Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


models = load(EXAMPLES / "models.py", "volga_example_models")


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A copy of the examples, their model files fetched next to their specs."""
    root = tmp_path_factory.mktemp("examples")
    for example in ONNX_EXAMPLES:
        shutil.copytree(EXAMPLES / example, root / example)
        models.fetch(example, root / example)
        assert (root / example / "modelspec.yaml").read_text() == (EXAMPLES / example / "modelspec.yaml").read_text()
    return root


@pytest.fixture(scope="module")
def up(staged: pathlib.Path) -> Iterator[harness.UpProcess]:
    files = [a for example in ONNX_EXAMPLES for a in ("-f", str(staged / example / "modelspec.yaml"))]
    with harness.volga_up(files) as running:
        yield running


def direct(**files: pathlib.Path) -> Callable[[str, dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """onnxruntime on the model files themselves, by the model ids the examples' specs give them."""
    sessions = {model.replace("_", "-"): ort.InferenceSession(str(f)) for model, f in files.items()}

    def infer(model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        session = sessions[model]
        return dict(zip([o.name for o in session.get_outputs()], session.run(None, inputs), strict=True))

    return infer


def close(got: object, want: object) -> None:
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_onnx_vision_example(staged: pathlib.Path, up: harness.UpProcess) -> None:
    client = load(staged / "vision" / "client.py", "volga_example_vision")
    lines = [client.text_image("Volga keeps models frozen"),
             client.text_image("Volga keeps models frozen", upside_down=True)]
    got = client.classify(client.triton_infer(up.endpoints["grpc"]), lines)
    want = client.classify(direct(text_direction=staged / "vision" / "text-direction.onnx"), lines)
    assert got.shape == (2, 2)
    close(got, want)


def test_stateful_streaming_example_feeds_its_state_back(staged: pathlib.Path, up: harness.UpProcess) -> None:
    client = load(staged / "streaming-vad" / "client.py", "volga_example_vad")
    audio = client.test_audio()
    got = client.stream(client.triton_infer(up.endpoints["grpc"]), audio)
    want = client.stream(direct(silero_vad=staged / "streaming-vad" / "silero_vad.onnx"), audio)
    assert len(got) == len(audio) // client.CHUNK
    close(got, want)
    # The state matters: the same chunks, each with a fresh state, answer otherwise.
    alone = direct(silero_vad=staged / "streaming-vad" / "silero_vad.onnx")
    fresh = [client.stream(alone, audio[i:i + client.CHUNK])[0]
             for i in range(0, len(audio) - client.CHUNK + 1, client.CHUNK)]
    assert not np.allclose(fresh, want)


def test_fp16_example(staged: pathlib.Path, up: harness.UpProcess) -> None:
    client = load(staged / "fp16" / "client.py", "volga_example_fp16")
    audio = load(staged / "streaming-vad" / "client.py", "volga_example_vad_audio").test_audio(seed=3)
    got = client.stream(client.triton_infer(up.endpoints["http"].removeprefix("http://")), audio)
    want = client.stream(direct(silero_vad_half=staged / "fp16" / "silero_vad_half.onnx"), audio)
    close(got, want)


def test_pipeline_example_chains_two_models(staged: pathlib.Path, up: harness.UpProcess) -> None:
    client = load(staged / "pipeline" / "client.py", "volga_example_pipeline")
    image = client.text_image("VOLGA 2026")
    got = client.read(client.triton_infer(up.endpoints["grpc"]), image)
    folder = staged / "pipeline"
    want = client.read(direct(text_detection=folder / "text-detection.onnx",
                              text_recognition=folder / "text-recognition.onnx"), image)
    assert got.box == want.box
    close(got.text_map, want.text_map)
    close(got.scores, want.scores)
    chars = client.charset(folder / "text-recognition.onnx")
    assert "".join(chars[i] for i in got.indices()).replace(" ", "") == "VOLGA2026"


def test_openai_server_example_frozen_and_woken_by_a_request(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: pathlib.Path) -> None:
    """examples/openai-server (a copy: its first start writes its checkpoint beside it) as its modelspec.yaml says to
    run it: `volga up -f` it (the `python` on PATH has FastAPI and uvicorn), and its client streams a completion
    through the gateway. The server rests FROZEN (its image, no process); the first request wakes it, the answer
    arrives in several pieces, the same as the server's own decoding of that prompt; idle, it is frozen again, and
    the next request wakes it alike."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import os

    from procs import series, tiers, wait_for

    folder = tmp_path / "openai-server"
    shutil.copytree(EXAMPLES / "openai-server", folder)
    client = load(folder / "client.py", "volga_example_openai_client")
    monkeypatch.chdir(folder)  # where its module, loaded here, writes its checkpoint
    server = load(folder / "server.py", "volga_example_openai_server")
    monkeypatch.setenv("PATH", f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")

    prompt = "the river"
    want = list(server.engine.tokens(prompt, 16))
    with harness.volga_up(["-f", str(folder / "modelspec.yaml"), "--idle-sec", "1"]) as up:
        for woken in (1.0, 2.0):
            wait_for("the server frozen", lambda: tiers(up.endpoints["agent"], "toy-llm") == ["FROZEN"], every=0.5)
            pieces = list(client.stream(up.endpoints["http"], prompt))
            assert pieces == want and len(set(want)) > 2
            # a wake from its image each time, not a cold start in its place
            wakes = series(up.endpoints["metrics"], "volga_activations_total")
            assert wakes.get('{model="toy-llm",tier="FROZEN"}') == woken, wakes
            assert not series(up.endpoints["metrics"], "volga_snapshot_restore_failures_total"), "a wake fell back"
