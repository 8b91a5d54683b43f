"""`volga bench slo` with tiny durations: it builds and calibrates its models, runs `volga up` with autonomy off
and on under the same load, and prints the keys its report promises (no timing is asserted)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from volga_bench import slo

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_bench_slo_prints_its_numbers() -> None:
    out = subprocess.run([sys.executable, "-m", "volga_agent.cli", "bench", "slo", "--json", "--seconds", "3",
                          "--pulse-every", "2", "--pulse-seconds", "1", "--calibrate-iterations", "10"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    for side in ("autonomy_off", "autonomy_on"):
        assert {"violating_windows", "p99_ms", "episodes_past_deadline"} <= set(report[side])
        assert report[side]["windows_judged"] > 0
    assert set(report["decision_us"]) == {"p50", "p99"} and report["decision_us"]["p50"] is not None
    assert report["sampling_jitter_ms"]["p99"] is not None
    assert {"shed", "p99_ms"} <= set(report["tolerant"]["on"]) and "p99_ms" in report["tolerant"]["off"]
    assert report["tolerant"]["off"]["shed"] == 0  # nothing sheds without the loop
    # The protected model alone: its windows judged, and no tolerant request sent.
    assert report["protected_alone"]["windows_judged"] > 0 and report["tolerant"]["alone"]["requests"] == 0
    assert set(report["violating_windows_above_alone"]) == {"off", "on"}
    assert report["baseline_p99_ms"][slo.PROTECTED] > 0 and len(report["load_average"]) == 3
    # Where the CPU went, per window, and what each calibration measured.
    cpu = report["runs"]["on"][0]["cpu"]
    assert cpu["windows"]["violating"] + cpu["windows"]["ok"] > 0
    assert {"gateway", "clients", slo.PROTECTED, slo.TOLERANT, "other", "tolerant_in_flight"} <= set(
        cpu["cpu_ms_per_window"]["ok"] or cpu["cpu_ms_per_window"]["violating"])
    assert cpu["cpu_ms_per_window"]["ok"].get(slo.PROTECTED, 1.0) > 0 or cpu["windows"]["ok"] == 0
    for model in (slo.PROTECTED, slo.TOLERANT):
        assert 1 <= len(report["calibration"][model]["attempts"]) <= slo.CALIBRATION_ATTEMPTS


def test_the_histogram_quantiles_interpolate_within_buckets() -> None:
    text = "\n".join(['x_bucket{le="10.0"} 50.0', 'x_bucket{le="20.0"} 90.0', 'x_bucket{le="+Inf"} 100.0'])
    q = slo.histogram_quantiles(text, "x", (0.5, 0.7, 0.99))
    assert q[0.5] == pytest.approx(10.0) and q[0.7] == pytest.approx(15.0) and q[0.99] == pytest.approx(20.0)
    assert slo.histogram_quantiles("", "x", (0.5,)) == {0.5: None}


def test_violating_windows_and_episodes_are_counted_by_completion_time() -> None:
    records = [slo.Record(slo.PROTECTED, t, ms, "OK") for t, ms in
               ((0.01, 5.0), (0.11, 50.0), (0.21, 60.0), (0.31, 5.0), (0.41, 70.0))]
    records.append(slo.Record(slo.TOLERANT, 0.0, 500.0, "OK"))
    judged = slo.judge(records, limit_ms=10.0, deadline_ms=150.0, seconds=0.5)
    assert (judged["violating_windows"], judged["episodes"], judged["episodes_past_deadline"]) == (3, 2, 1)
    assert judged["violating_at_s"] == [0.1, 0.2, 0.4]
    assert slo.retry_hint_ms("model 'heavy' is shedding load; retry after 1000 ms") == 1000.0


def test_the_cpu_of_violating_windows_is_told_apart_from_the_others() -> None:
    records = [slo.Record(slo.PROTECTED, 0.01, 5.0, "OK"), slo.Record(slo.PROTECTED, 0.11, 50.0, "OK"),
               slo.Record(slo.PROTECTED, 0.21, 5.0, "OK"), slo.Record(slo.TOLERANT, 0.05, 150.0, "OK")]
    rows = [{"gateway": 1.0, "clients": 2.0, slo.PROTECTED: 5.0, slo.TOLERANT: 10.0, "other": 0.0},
            {"gateway": 3.0, "clients": 2.0, slo.PROTECTED: 5.0, slo.TOLERANT: 90.0, "other": 20.0},
            {}]  # a window whose workers changed: not counted
    judged = slo.judge(records, limit_ms=10.0, deadline_ms=1000.0, seconds=0.3)
    cpu = slo.attribute(records, rows, judged["violating_at_s"], 10.0)
    assert cpu["windows"] == {"violating": 1, "ok": 1}
    assert cpu["cpu_ms_per_window"]["violating"][slo.TOLERANT] == 90.0
    assert cpu["cpu_ms_per_window"]["violating"]["tolerant_in_flight"] == 1.0
    assert cpu["cpu_ms_per_window"]["ok"][slo.TOLERANT] == 10.0
    assert [w["at_s"] for w in cpu["violating"]] == [0.1] and cpu["violating"][0]["p99_ms"] == 50.0
    assert cpu["protected_requests_per_window"] == {"mean": 1.0, "max": 1}


def test_the_throttle_arm_is_run_beside_the_yield_alone() -> None:
    config = slo.Config(throttle_share=0.75, throttle_period_ms=25.0)
    assert config.arms == ("alone", "off", "yield", "on") and slo.Config(alone=False).arms == ("off", "on")
    # Calibrated as the protected model's traffic comes, unless told otherwise.
    assert config.pace_ms == 125.0 and slo.Config(calibrate_pace_ms=0).pace_ms == 0
    assert "autonomyThrottleShare" not in config.settings("yield") and config.settings("yield")["autonomyYieldNice"]
    assert (config.settings("on")["autonomyThrottleShare"], config.settings("on")["autonomyThrottlePeriodMs"]) == (
        0.75, 25.0)
    side = {"violating_windows": 0, "windows_judged": 1, "p99_ms": 1.0, "episodes": 0, "episodes_past_deadline": 0,
            "longest_episode_ms": 0.0}
    tolerant = {"requests": 2, "answered": 2, "shed": 0, "other_errors": 0, "p99_ms": 3.0, "p50_ms": 2.0}
    one = {"decision_us": {"p50": 1.0, "p99": 2.0}, "sampling_jitter_ms": {"p50": 0.1, "p99": 0.2},
           "tolerant": tolerant,
           "cpu": {"cpu_ms_per_window": {"violating": {}, "ok": {}}, "windows": {}}}
    runs = {arm: [{**one, "protected": {**side, "violating_windows": n}}] for arm, n in
            (("alone", 1), ("off", 12), ("yield", 6), ("on", 2))}
    report = slo.report(config, {slo.PROTECTED: 1.0, slo.TOLERANT: 2.0}, 1.15, runs)
    assert report["autonomy_yield"]["violating_windows"] == 6 and report["autonomy_on"]["violating_windows"] == 2
    assert report["throttle"] == {"share": 0.75, "period_ms": 25.0, "guard": False,
                                  "fewer_violating_windows_than_yield_x": 3.0}
    assert set(report["tolerant"]) == {"alone", "off", "yield", "on"} and report["fewer_violating_windows_x"] == 6.0
    # The protected model alone: the floor, and each arm above it.
    assert report["protected_alone"]["violating_windows"] == 1
    assert report["violating_windows_above_alone"] == {"off": 11, "yield": 5, "on": 1}
    assert report["fewer_violating_windows_above_alone_x"] == 11.0
    text = slo.format_report({**report, "calibration": {}})
    assert "    yield" in text and "3.0x fewer violating windows than the yield alone" in text
    assert "    alone" in text and "alone: off 11, on 1 (11.0x fewer)" in text
    assert "autonomy_yield" not in slo.report(slo.Config(), {slo.PROTECTED: 1.0, slo.TOLERANT: 2.0}, 1.15,
                                              {arm: runs[arm] for arm in ("off", "on")})
    assert "protected_alone" not in slo.report(slo.Config(alone=False), {slo.PROTECTED: 1.0, slo.TOLERANT: 2.0}, 1.15,
                                               {arm: runs[arm] for arm in ("off", "on")})
