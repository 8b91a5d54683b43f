"""Where a node lets a model server run (`serverpool.check_source`): only with model code allowed, and only from
its model roots; each refusal names the field and the reason. And the pool's bookkeeping of its servers: leases
given back, resting tiers, failed idle demotions tried again later."""

from __future__ import annotations

import pathlib
import time

import pytest

from volga_agent.node import instance, server, serverpool
from volga_core import api


def spec(source: pathlib.Path, working_dir: pathlib.Path | None = None) -> api.ModelSpecSpec:
    server: dict[str, object] = {"command": ["python", "-m", "app", "--port", "{port}"]}
    if working_dir is not None:
        server["workingDir"] = str(working_dir)
    return api.ModelSpecSpec.model_validate({"modelId": "srv", "framework": "server", "source": str(source),
                                             "server": server})


def test_a_server_from_a_model_root_runs_where_model_code_is_allowed(tmp_path: pathlib.Path) -> None:
    (tmp_path / "app").mkdir()
    serverpool.check_source(spec(tmp_path / "app", tmp_path / "app"), [str(tmp_path)], allow_model_code=True)


@pytest.mark.parametrize(("source", "working_dir", "allowed", "words"), [
    ("app", None, False, "spec.framework: server runs the command"),
    ("missing", None, True, "does not exist on this node"),
    ("../outside", None, True, "outside the model roots"),
    ("app", "../outside", True, "spec.server.workingDir: resolves to"),
])
def test_refusals_name_the_field(tmp_path: pathlib.Path, source: str, working_dir: str | None, allowed: bool,
                                 words: str) -> None:
    root = tmp_path / "root"
    (root / "app").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    given = spec(root / source, None if working_dir is None else root / working_dir)
    with pytest.raises(ValueError) as caught:
        serverpool.check_source(given, [str(root)], allow_model_code=allowed)
    assert words in str(caught.value)


class _Held:
    """What the lease bookkeeping touches of a server instance: its release, tier, process and last use."""

    def __init__(self) -> None:
        self.released = 0
        self.tier = api.Tier.HOT
        self.in_flight = 1
        self.last_used = 0.0
        self.name = "ns.held-0"
        self.pid = None  # no process: nothing to find dead

    def release(self) -> None:
        self.released += 1


def test_an_activation_never_released_is_given_back(monkeypatch: pytest.MonkeyPatch) -> None:
    import concurrent.futures

    from volga_agent import metrics
    from volga_agent.node.settings import Settings

    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        servers = serverpool.ServerPool("n", pathlib.Path("/nonexistent"), None, Settings(), metrics.AgentMetrics(),
                                        executor)
        held = _Held()
        slot = serverpool.ServerSlot(held, api.Tier.HOT, leases=[0.0, 1.0])  # type: ignore[arg-type]
        servers.slots[held.name] = slot
        servers.release(held.name)  # the first activation's gateway answered
        assert held.released == 1 and slot.leases == [1.0]
        monkeypatch.setattr(serverpool, "LEASE_MAX_SEC", 0.0)
        servers.tick()  # the second's never did: given back
        assert held.released == 2 and slot.leases == []
        servers.release(held.name)  # its release, late: not counted twice
        assert held.released == 2


@pytest.mark.parametrize(("driver", "rests"), [
    (None, {api.Tier.WARM: api.Tier.FROZEN, api.Tier.SUSPENDED: api.Tier.FROZEN}),
    (object(), {api.Tier.WARM: api.Tier.WARM, api.Tier.SUSPENDED: api.Tier.SUSPENDED}),
])
def test_gpu_floors_rest_where_the_node_has_a_driver(driver: object, rests: dict[api.Tier, api.Tier]) -> None:
    import concurrent.futures

    from volga_agent import metrics
    from volga_agent.node.settings import Settings

    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        servers = serverpool.ServerPool("n", pathlib.Path("/nonexistent"), None, Settings(), metrics.AgentMetrics(),
                                        executor, driver)  # type: ignore[arg-type]
        assert {tier: servers.resting(tier) for tier in rests} == rests
        assert [servers.resting(t) for t in (api.Tier.HOT, api.Tier.FROZEN, api.Tier.COLD)] == [
            api.Tier.HOT, api.Tier.FROZEN, api.Tier.COLD]


def test_a_relative_working_folder_lies_in_the_source_folder(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "root"
    (root / "app" / "src").mkdir(parents=True)
    (root / "app" / "main.py").write_text("")
    given = api.ModelSpecSpec.model_validate({"modelId": "srv", "framework": "server", "source": str(root / "app"),
                                              "server": {"command": ["x"], "workingDir": "src"}})
    serverpool.check_source(given, [str(root)], allow_model_code=True)
    assert instance.server_folder(given) == root / "app" / "src"
    one_file = given.model_copy(update={"source": str(root / "app" / "main.py"), "server": None})
    assert instance.server_folder(one_file) == root / "app"  # a file's folder
    assert given.server is not None
    missing = given.model_copy(update={"server": given.server.model_copy(update={"working_dir": "gone"})})
    with pytest.raises(ValueError, match=r"spec.server.workingDir: .*/app/gone does not exist on this node"):
        serverpool.check_source(missing, [str(root)], allow_model_code=True)


class _Holding:
    """A HOT server whose idle demotion fails while it holds a connection open."""

    name = "holding-0"
    tier = api.Tier.HOT
    pid = None
    in_flight = 0
    last_used = 0.0

    def __init__(self) -> None:
        self.tries = 0
        self.holds = True

    def demote_if_idle(self, *_: object) -> bool:
        self.tries += 1
        if self.holds:
            raise server.HoldsConnections("holding-0: it holds TCP connections open: pid 7 (python): ...")
        self.tier = api.Tier.FROZEN
        return True


def test_a_failed_idle_demotion_is_tried_again_later_and_later() -> None:
    """Each try runs the server's hooks and has criu seize its tree: after a failure the next waits, twice as long
    after each (up to RETRY_MAX_SEC), and a success forgets the failures and their reason."""
    import concurrent.futures

    from volga_agent import metrics
    from volga_agent.node.settings import Settings

    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        servers = serverpool.ServerPool("n", pathlib.Path("/nonexistent"), None, Settings(), metrics.AgentMetrics(),
                                        executor)
        holding = _Holding()
        slot = serverpool.ServerSlot(holding, api.Tier.FROZEN)  # type: ignore[arg-type]
        servers.slots[holding.name] = slot

        def tick() -> None:
            servers.tick()
            servers.wait_converged(10.0)

        tick()
        assert holding.tries == 1 and slot.failures == 1
        assert slot.reason.startswith("Idle: HoldsConnections: holding-0: it holds TCP connections open")
        waited = slot.retry_at - time.monotonic()
        assert serverpool.RETRY_FIRST_SEC - 1 < waited <= serverpool.RETRY_FIRST_SEC
        tick()
        assert holding.tries == 1  # not before its time
        slot.retry_at = 0.0
        tick()
        assert holding.tries == 2 and slot.retry_at - time.monotonic() > serverpool.RETRY_FIRST_SEC
        slot.failures = 20
        slot.retry_at = 0.0
        tick()
        assert slot.retry_at - time.monotonic() <= serverpool.RETRY_MAX_SEC
        holding.holds = False
        slot.retry_at = 0.0
        tick()
        assert holding.tier is api.Tier.FROZEN and (slot.failures, slot.retry_at, slot.reason) == (0, 0.0, "")
