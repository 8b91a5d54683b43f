"""Node settings in groups: the flat names the chart and `volga up` use, the nested form, and their errors."""

from __future__ import annotations

import argparse
import pathlib

import pytest

from volga_agent import cli
from volga_agent.node import settings as node_settings
from volga_agent.node.settings import AutonomySettings, Settings

# Every setting by its flat name, with the default it had when the settings were one flat model.
FLAT_DEFAULTS: dict[str, object] = {
    "snapshot_interval_sec": 30.0, "warmup_cache_ratio": 0.0, "gateway_cache_ttl_sec": 60.0,
    "scheduler_eviction_policy": "lru", "reset_rng_on_restore": True, "numa_affinity": False, "max_failures": 5,
    "backoff_duration_sec": 600.0, "api_writes_per_sec": 200.0, "hot_idle_sec": 60.0, "warm_idle_sec": 300.0,
    "suspended_idle_sec": 900.0, "host_memory_budget_bytes": 0, "gpu_memory_budget_bytes": 0,
    "snapshot_disk_budget_bytes": 0, "lazy_restore": None, "verify_restores": True, "gpu_stack_bytes": 64,
    "gpu_graphs_in_images": False, "parked_huge_pages": True, "keep_failed_restores": 3, "autonomy_sample_ms": 10.0,
    "autonomy_window_samples": 10, "autonomy_hysteresis_windows": 3, "autonomy_preload_below_pct": 40.0,
    "autonomy_optimize_above_pct": 70.0, "autonomy_emergency_above_pct": 85.0, "autonomy_preload_min_rate": 1.0,
    "autonomy_idle_windows": 3, "autonomy_shed_retry_after_ms": 1000, "autonomy_debug": False,
    "autonomy_enabled": False, "autonomy_emergency_windows": 0, "autonomy_calm_windows": 0,
    "autonomy_deadline_share_pct": 100.0, "autonomy_exchange_ms": 50.0, "autonomy_yield_nice": 0,
    "autonomy_yield_tolerance_ratio": 2.0, "autonomy_yield_calm_windows": 10, "autonomy_yield_sched_idle": True,
    "autonomy_throttle_share": 0.0, "autonomy_throttle_period_ms": 20.0, "autonomy_throttle_guard": False,
    "model_roots": (), "allow_model_code": False, "max_instances": 0, "host_memory_fraction": 0.8,
    "criu_timeout_floor_sec": 10.0, "criu_timeout_sec_per_gib": 10.0, "criu_lazy_pages_server": "volga",
    "criu_lazy_pages_threads": 0, "criu_lazy_pages_fill": "auto", "verify_image_checksums": True,
    "shared_snapshots": "", "shared_snapshot_budget_bytes": 0, "shared_snapshot_grace_sec": 600.0,
    "shared_snapshots_node_local": False,
    "neighbours_enabled": False, "neighbours_period_ms": 200.0, "autonomy_heartbeat_sec": 5.0,
    "worker_user": "nobody", "unprivileged_snapshots": False, "keep_warm_below_gpu_pct": 50.0,
    "gpu_restores_at_once": 0, "gpu_restore_lead": True,
}


def read(settings: Settings, path: tuple[str, ...]) -> object:
    value: object = settings
    for part in path:
        value = getattr(value, part)
    return value


def test_every_flat_name_has_its_place_and_its_default() -> None:
    snake = {name: path for name, path in node_settings._paths().items() if "_" in name}  # not the camelCase
    assert sorted(snake) == sorted(FLAT_DEFAULTS)
    settings = Settings()
    for name, default in FLAT_DEFAULTS.items():
        assert read(settings, snake[name]) == default, name
    # Each field of the model has exactly one flat name.
    fields = [(name,) for name, field in Settings.model_fields.items() if name not in node_settings._groups()]
    fields += [(group, inner) for group, model in node_settings._groups().items() for inner in model.model_fields]
    assert sorted(fields) == sorted(set(snake.values()))


def test_flat_and_nested_names_build_the_same_settings() -> None:
    flat = Settings.from_mapping({"autonomy_enabled": True, "autonomyHysteresisWindows": 5, "hot_idle_sec": 10,
                                  "gpuMemoryBudgetBytes": 1024, "max_failures": 2, "criu_timeout_floor_sec": 3.0,
                                  "sharedSnapshots": "/mnt/shared", "neighbours_period_ms": 100.0})
    nested = Settings.from_mapping({"autonomy": {"enabled": True, "hysteresisWindows": 5}, "idle": {"hotSec": 10},
                                    "budgets": {"gpu_memory_bytes": 1024}, "breaker": {"maxFailures": 2},
                                    "criu": {"timeout_floor_sec": 3.0}, "shared": {"folder": "/mnt/shared"},
                                    "neighbours": {"periodMs": 100.0}})
    assert flat == nested == Settings(autonomy_enabled=True, autonomy_hysteresis_windows=5, hot_idle_sec=10.0,
                                      gpu_memory_budget_bytes=1024, max_failures=2, criu_timeout_floor_sec=3.0,
                                      shared_snapshots="/mnt/shared", neighbours_period_ms=100.0)
    assert (flat.autonomy.enabled, flat.autonomy.hysteresis_windows, flat.idle.hot_sec) == (True, 5, 10.0)
    assert (flat.budgets.gpu_memory_bytes, flat.breaker.max_failures, flat.shared.folder) == (1024, 2, "/mnt/shared")
    mixed = Settings.from_mapping({"autonomy_enabled": True, "autonomy": {"debug": True}})
    assert mixed.autonomy.enabled and mixed.autonomy.debug
    assert Settings(autonomy=AutonomySettings(debug=True), autonomy_enabled=True) == mixed


@pytest.mark.parametrize(("data", "message"), [
    ({"autonomy_enabled": True, "autonomy": {"enabled": False}},
     r"settings\.autonomy_enabled: given twice \(as 'autonomy_enabled' and 'autonomy\.enabled'\)"),
    ({"autonomy": {"sampleMs": 1.0, "sample_ms": 2.0}}, r"settings\.autonomy\.sample_ms: given twice"),
    ({"autonomy": {"enabeld": True}}, r"settings\.autonomy\.enabeld: unknown setting \(did you mean 'enabled'\?\)"),
    ({"autonomy_enabeld": True}, r"settings\.autonomy_enabeld: unknown setting \(did you mean 'autonomy_enabled'\?\)"),
    ({"autonomy": 5}, r"settings\.autonomy: must be a mapping, got 5"),
    ({"autonomy": {"sampleMs": 0}}, r"settings\.autonomy\.sample_ms: must be > 0, got 0"),
    ({"autonomySampleMs": 0}, r"settings\.autonomy_sample_ms: must be > 0, got 0"),
    ({"idle": {"warm_sec": 30}}, r"settings\.idle\.warm_sec: must be >= idle\.hot_sec \(60\), got 30"),
    ({"autonomy_optimize_above_pct": 30}, r"settings\.autonomy_optimize_above_pct: must be >= "
                                          r"autonomy_preload_below_pct \(40\), got 30"),
    ({"budgets": {"gpu_memory_budget_bytes": 1}}, r"settings\.budgets\.gpu_memory_budget_bytes: unknown setting"),
])
def test_errors_name_the_setting_as_given(data: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Settings.from_mapping(data)


def test_overlay_replaces_a_setting_however_it_is_spelled() -> None:
    base = {"autonomy": {"enabled": False, "debug": True}, "hotIdleSec": 5, "maxFailures": 3}
    merged = Settings.overlay(base, {"autonomy_enabled": True, "hot_idle_sec": 6})
    assert merged == {"autonomy": {"debug": True}, "maxFailures": 3, "autonomy_enabled": True, "hot_idle_sec": 6}
    assert Settings.overlay({"autonomy": {"debug": True}}, {"autonomy": {"enabled": True}}) == {
        "autonomy": {"debug": True, "enabled": True}}


def test_volga_up_flags_override_a_nested_settings_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "settings.yaml"
    path.write_text("autonomy:\n  enabled: false\n  debug: true\nidle:\n  hotSec: 1\n")
    args = cli.build_parser().parse_args(["up", "--autonomy", "--settings", str(path), "--idle-sec", "7",
                                          "--set", "neighbours_period_ms=100"])
    assert isinstance(args, argparse.Namespace)
    settings = cli.settings_from(args)
    assert settings.autonomy.enabled and settings.autonomy.debug
    assert (settings.idle.hot_sec, settings.idle.suspended_sec, settings.neighbours.period_ms) == (7, 7, 100)
    path.write_text("autonomy:\n  debug: true\nautonomy_debug: false\n")
    with pytest.raises(ValueError, match=r"settings\.autonomy\.debug: given twice"):
        cli.settings_from(cli.build_parser().parse_args(["up", "--settings", str(path)]))
