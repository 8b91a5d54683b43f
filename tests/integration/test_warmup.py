"""Declared warm-up through a real `volga up`: a real model (Silero VAD, whose STFT pads in reflect mode) that fails
with the made-up default warm-up and reaches FROZEN with declared inputs; the failure names the warm-up sample in
the instance's reason, the repository index and the `volga up` log. `volga status` reads the same `volga up`. The
samples' checks without a worker: tests/unit/test_warmup_samples.py."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from procs import wait_for
from silero_specs import GOOD, SILERO, document

from volga_bench import harness

# --- a real model through a real `volga up` ---------------------------------------------------------------------


def status(up: harness.UpProcess) -> dict[str, dict[str, Any]]:
    out = subprocess.run([sys.executable, "-m", "volga_agent.cli", "status", "--agent", up.endpoints["agent"],
                          "--json"], capture_output=True, text=True, timeout=60, check=True)
    return {m["modelId"]: m for m in json.loads(out.stdout)["models"]}


@pytest.mark.slow
def test_a_model_that_refuses_made_up_inputs_reaches_frozen_with_declared_ones(tmp_path: pathlib.Path) -> None:
    np.savez(tmp_path / "speech.npz", input=np.full((1, 576), 0.1, np.float32), sr=np.array(16000))
    bad_sample = {"inputs": {"input": {"shape": [1, 1], "fill": 0}}}
    docs = [document("vad-made-up"), document("vad", {"warmup": GOOD}),
            document("vad-file", {"warmupFile": "speech.npz"}),
            document("vad-bad-sample", {"warmup": [*GOOD, bad_sample]})]
    (tmp_path / "vad.yaml").write_text(yaml.safe_dump_all(docs))
    # The model file lives in the installed package, outside the spec's folder (the default model root).
    with harness.volga_up(["-f", str(tmp_path / "vad.yaml"), "--model-root", str(SILERO.parent)]) as up:
        def settled() -> dict[str, dict[str, Any]] | None:
            now = status(up)
            done = all(m["tiers"].get("FROZEN") or (m["instanceList"] and m["instanceList"][0]["reason"])
                       for m in now.values())
            return now if done else None

        models = wait_for("every model frozen or failed", settled, timeout=240, every=0.5)
        assert models["vad"]["tiers"] == {"FROZEN": 1} and models["vad"]["imageBytes"] > 0
        assert models["vad-file"]["tiers"] == {"FROZEN": 1}
        made_up = models["vad-made-up"]["instanceList"][0]
        assert made_up["tier"] == "COLD"
        assert ("WarmupError: warm-up with made-up inputs (declare runtime.warmup to give real ones; input 'input' "
                "shape [1, 1], input 'state' shape [2, 1, 128], input 'sr' shape []): ") in made_up["reason"]
        assert "Pad reflect requires axis length >= 2" in made_up["reason"]
        bad = models["vad-bad-sample"]["instanceList"][0]["reason"]
        assert ("warm-up sample 1 (input 'input' shape [1, 1], input 'state' shape [2, 1, 128], input 'sr' shape "
                "[]): ") in bad

        client = grpcclient.InferenceServerClient(up.endpoints["grpc"])
        index = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
        assert index["vad"]["state"] == "READY" and index["vad"]["reason"] == "FROZEN (1 instance)"
        assert index["vad-made-up"]["state"] == "UNAVAILABLE"
        assert "COLD (1 instance)" in index["vad-made-up"]["reason"]
        assert "warm-up with made-up inputs" in index["vad-made-up"]["reason"]
        inputs = []
        for name, array in (("input", np.zeros((1, 576), np.float32)), ("state", np.zeros((2, 1, 128), np.float32)),
                            ("sr", np.array(16000, np.int64))):
            tensor = grpcclient.InferInput(name, list(array.shape), "INT64" if name == "sr" else "FP32")
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        assert client.infer("vad", inputs).as_numpy("output").shape == (1, 1)
        client.close()
        woken = status(up)["vad"]
        assert woken["lastUsed"] and woken["lastWakeMs"] > 0
        table = subprocess.run([sys.executable, "-m", "volga_agent.cli", "status", "--agent", up.endpoints["agent"]],
                               capture_output=True, text=True, timeout=60, check=True).stdout
        header, *rows = table.splitlines()
        assert header.split() == ["MODEL", "INSTANCES", "TIERS", "LAST", "USED", "LAST", "WAKE", "IMAGES"]
        assert any(r.startswith("vad-made-up-0 (vad-made-up, COLD): WorkerStartError") for r in rows)
    log = "".join(up.output)
    assert "vad-made-up-0: could not reach FROZEN" in log and "warm-up with made-up inputs" in log
