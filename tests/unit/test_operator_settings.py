"""The operator reads its environment in one place (`volga_operator.settings.Settings.from_environ`)."""

from __future__ import annotations

import pytest

from volga_operator import loop as reconcile_loop
from volga_operator.settings import Settings


def test_an_unset_environment_gives_the_defaults() -> None:
    assert Settings.from_environ({}) == Settings()
    assert Settings() == Settings(metrics_host="0.0.0.0", metrics_port=-1, metrics_token_file="", namespace="default",
                                  chain_migration_after_sec=30.0, chain_migration_min_interval_sec=300.0,
                                  resync_sec=60.0, debounce_sec=0.2, api_writes_per_sec=200.0)


def test_each_variable_sets_its_field() -> None:
    settings = Settings.from_environ({
        "VOLGA_METRICS_HOST": "127.0.0.1", "VOLGA_METRICS_PORT": "9100", "VOLGA_METRICS_TOKEN_FILE": "/t",
        "VOLGA_NAMESPACE": "volga-system", "VOLGA_CHAIN_MIGRATION_AFTER_SEC": "45",
        "VOLGA_CHAIN_MIGRATION_MIN_INTERVAL_SEC": "600", "VOLGA_RESYNC_SEC": "5", "VOLGA_DEBOUNCE_SEC": "0.05",
        "VOLGA_API_WRITES_PER_SEC": "50"})
    assert settings == Settings("127.0.0.1", 9100, "/t", "volga-system", 45.0, 600.0, 5.0, 0.05, 50.0)


@pytest.mark.parametrize(("environ", "namespace"), [
    ({"POD_NAMESPACE": "pods"}, "pods"),
    ({"VOLGA_NAMESPACE": "volga", "POD_NAMESPACE": "pods"}, "volga"),
    ({"VOLGA_NAMESPACE": "", "POD_NAMESPACE": "pods"}, "pods"),
    ({"VOLGA_NAMESPACE": "", "POD_NAMESPACE": ""}, "default"),
])
def test_the_namespace_falls_back_to_the_pods_then_default(environ: dict[str, str], namespace: str) -> None:
    assert Settings.from_environ(environ).namespace == namespace


def test_a_number_that_does_not_parse_stops_the_operator() -> None:
    with pytest.raises(ValueError):
        Settings.from_environ({"VOLGA_RESYNC_SEC": "soon"})


def test_the_loop_takes_its_settings() -> None:
    loop = reconcile_loop.Loop(Settings(chain_migration_after_sec=45.0, chain_migration_min_interval_sec=600.0,
                                        api_writes_per_sec=50.0))
    assert (loop.state.tier.migrate_after_sec, loop.state.tier.min_interval_sec) == (45.0, 600.0)
    assert loop.window.limit == 50 and loop.settings.namespace == "default"
