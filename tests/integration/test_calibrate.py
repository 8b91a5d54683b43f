"""`volga calibrate` on the default model with a real worker, through a gateway and alone, `--write` into a
ModelSpec file; and `volga bench decide` printing its keys. The autonomy loop's use of status.calibrated:
tests/unit/test_calibrated_baselines.py."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import yaml

from volga_agent.app import defaultmodel
from volga_core import api

ROOT = pathlib.Path(__file__).resolve().parents[2]


def volga(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "volga_agent.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.fixture
def spec_file(tmp_path: pathlib.Path) -> pathlib.Path:
    document = defaultmodel.ensure().to_wire()
    path = tmp_path / "model.yaml"
    path.write_text("# kept: a comment about this model\n" + yaml.safe_dump(document, sort_keys=False))
    return path


def test_calibrate_measures_with_a_real_worker_and_writes_tagged_baselines(spec_file: pathlib.Path) -> None:
    before = spec_file.read_text()
    out = volga("calibrate", "-f", str(spec_file), "--batch-sizes", "1,4", "--iterations", "30", "--json", "--write")
    assert out.returncode == 0, out.stderr
    calibration = api.Calibration.model_validate(json.loads(out.stdout))
    spec = defaultmodel.ensure().spec
    assert (calibration.device, calibration.version, calibration.input_hash) == ("cpu", "1", spec.input_hash())
    assert [b.batch_size for b in calibration.batches] == [1, 4]
    for b in calibration.batches:
        assert 0 < b.p50_ms <= b.p99_ms and b.memory_bytes > 50 * 2**20 and b.throughput_per_sec > 0

    after = spec_file.read_text()
    assert after.startswith("# kept: a comment about this model\n")
    written = api.load_model_specs(spec_file)[0]
    assert written.spec.model_copy(update={"slo": spec.slo}) == spec  # nothing else changed
    slo = written.spec.slo
    assert slo.baseline_latency_ms == {"1": calibration.batches[0].p99_ms, "4": calibration.batches[1].p99_ms}
    assert slo.baseline_for == api.BaselineTag(version="1", input_hash=spec.input_hash(), device="cpu")
    assert slo.baselines_for("1", spec.input_hash()) == {1: calibration.batches[0].p99_ms,
                                                         4: calibration.batches[1].p99_ms}
    assert slo.baselines_for("2", spec.input_hash()) == {}  # a new version invalidates them
    assert before.count("\n") < after.count("\n")


def test_the_baseline_written_is_the_gateway_path(spec_file: pathlib.Path) -> None:
    """tritonclient through a gateway in front of the worker is the baseline; the worker alone is reported beside
    it; --direct measures only the worker, as before."""
    out = volga("calibrate", "-f", str(spec_file), "--batch-sizes", "1,8", "--iterations", "30", "--json", "--write")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["measuredThrough"] == "gateway"
    for b in report["batches"]:
        assert {"p50Ms", "p99Ms", "workerP50Ms", "workerP99Ms"} <= set(b)
        assert b["p99Ms"] > 0 and b["workerP99Ms"] > 0 and b["p99Ms"] != b["workerP99Ms"]
    slo = api.load_model_specs(spec_file)[0].spec.slo
    assert slo.baseline_latency_ms == {str(b["batchSize"]): b["p99Ms"] for b in report["batches"]}

    table = volga("calibrate", "-f", str(spec_file), "--batch-sizes", "1", "--iterations", "20")
    assert table.returncode == 0, table.stderr
    assert "through a gateway (tritonclient gRPC)" in table.stdout and "through the gateway" in table.stderr
    assert "worker p99" in table.stdout and "gateway +p99" in table.stdout

    direct = volga("calibrate", "-f", str(spec_file), "--batch-sizes", "1", "--iterations", "20", "--json",
                   "--direct")
    assert direct.returncode == 0, direct.stderr
    report = json.loads(direct.stdout)
    assert report["measuredThrough"] == "worker"
    [b] = report["batches"]
    assert b["p99Ms"] == b["workerP99Ms"] > 0


def test_a_paced_calibration_sends_one_request_every_pace(spec_file: pathlib.Path) -> None:
    """--pace-ms starts one timed request every so many ms, as sparse traffic comes; back to back is the default."""
    paced = volga("calibrate", "-f", str(spec_file), "--batch-sizes", "1", "--iterations", "10", "--pace-ms", "60",
                  "--json", "--direct")
    assert paced.returncode == 0, paced.stderr
    report = json.loads(paced.stdout)
    [b] = report["batches"]
    assert report["paceMs"] == 60 and b["p50Ms"] > 0 and b["throughputPerSec"] <= 1000 / 60
    back_to_back = volga("calibrate", "-f", str(spec_file), "--batch-sizes", "1", "--iterations", "10", "--json",
                         "--direct")
    assert back_to_back.returncode == 0, back_to_back.stderr
    report = json.loads(back_to_back.stdout)
    assert report["paceMs"] == 0 and report["batches"][0]["throughputPerSec"] > 1000 / 60
    # The spec's slo.calibrationPaceMs is the default; --pace-ms overrides it.
    document = yaml.safe_load(spec_file.read_text())
    document["spec"].setdefault("slo", {})["calibrationPaceMs"] = 30
    spec_file.write_text(yaml.safe_dump(document))
    from_spec = volga("calibrate", "-f", str(spec_file), "--batch-sizes", "1", "--iterations", "5", "--direct")
    assert from_spec.returncode == 0, from_spec.stderr
    assert "5 requests per batch size, one every 30 ms" in from_spec.stdout


def test_calibrate_refuses_bad_input(spec_file: pathlib.Path, tmp_path: pathlib.Path) -> None:
    out = volga("calibrate", "-f", str(spec_file), "--batch-sizes", "0,8")
    assert out.returncode == 2 and "--batch-sizes: '0,8': write batch sizes as positive integers" in out.stderr
    out = volga("calibrate", "-f", str(spec_file), "--pace-ms", "-5")
    assert out.returncode == 2 and "--pace-ms: -5.0: a request every 0 ms (back to back) or more" in out.stderr
    out = volga("calibrate", "-f", str(spec_file), "--batch-sizes", "1024")
    assert out.returncode == 2 and "[1024] above spec.runtime.maxBatchSize (256)" in out.stderr
    two = tmp_path / "two.yaml"
    first = yaml.safe_load(spec_file.read_text())
    second = {**first, "metadata": {"name": "other"}, "spec": {**first["spec"], "modelId": "other"}}
    two.write_text(yaml.safe_dump_all([first, second]))
    out = volga("calibrate", "-f", str(two))
    assert out.returncode == 2 and "2 ModelSpecs (ctr-default, other): choose one with --name" in out.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**first, "spec": {**first["spec"], "slo": {"interferenceTolerance": [{"pct": 5},
                                                                                                       {"pct": 9}]}}}))
    out = volga("calibrate", "-f", str(bad))
    assert out.returncode == 2
    assert "spec.slo.interferenceTolerance[0].belowLoadPct: required on every step but the last" in out.stderr


def test_bench_decide_prints_its_numbers() -> None:
    out = volga("bench", "decide", "--json", "--windows", "300", "--sample-seconds", "0.3")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["budget_p99_us"] == 50
    assert [r["models"] for r in report["decide"]] == [2, 4, 8, 16, 32, 64]
    for r in report["decide"]:
        assert {"p50_us", "p99_us", "max_us", "decisions", "within_budget", "states", "actions"} <= set(r)
        assert r["decisions"] == 300
    assert {"jitter_p50_ms", "jitter_p99_ms", "samples", "period_ms", "probe"} <= set(report["sampler"])
