"""What a ModelSpec may make a node open and create, and how many instances a node starts, decided without a
process or a server: model sources inside the model roots, instance folders inside the pool's, the node's caps;
the gateway's tokens. The real servers and daemons: tests/integration/test_security.py."""

from __future__ import annotations

import pathlib
import shutil
import tempfile

import pytest
from specs import spec_at

from volga_agent import auth
from volga_agent.app import defaultmodel
from volga_agent.node import admission, pool
from volga_agent.node.settings import Settings
from volga_core import api, planner

Tier = api.Tier


# --- model sources -------------------------------------------------------------------------------------------------


def test_model_sources_resolve_inside_the_model_roots(models: pathlib.Path, tmp_path: pathlib.Path,
                                                      rundir: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    outside = tmp_path / "outside.onnx"
    shutil.copy(models / "m.onnx", outside)
    (models / "link.onnx").symlink_to(outside)
    (models / "inner-link.onnx").symlink_to(models / "m.onnx")
    (models / "folder.onnx").mkdir()
    (models / "build.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    cases = {
        "inside": (f"file://{models}/m.onnx", "onnx", ""),
        "inner-link": (f"{models}/inner-link.onnx", "onnx", ""),
        "passwd": ("/etc/passwd", "onnx", "resolves to /etc/passwd, outside the model roots"),
        "dotdot": (f"{models}/../outside.onnx", "onnx", f"resolves to {outside}, outside the model roots"),
        "link": (f"{models}/link.onnx", "onnx", f"resolves to {outside}, outside the model roots"),
        "folder": (f"{models}/folder.onnx", "onnx", "which is not a regular file"),
        "missing": (f"{models}/nope.onnx", "onnx", f"model file {models}/nope.onnx does not exist"),
        "relative": ("m.onnx", "onnx", "must be an absolute path on the node"),
        "code": (f"{models}/build.py", "pytorch", "this node does not allow model code; use onnx or torchscript, "
                                                  "or allow it with settings.allow_model_code"),
    }
    specs = {name: spec_at(source, name, framework).spec for name, (source, framework, _) in cases.items()}
    desired = [planner.Desired(name, name, name, "n1", Tier.COLD) for name in cases]
    p = pool.Pool("n1", rundir, None, Settings(model_roots=(str(models),)))
    try:
        p.apply(desired, specs)
        reasons = {i.name: i.state_reason for i in p.instances(include_failed=True)}
        created = set(p.slots)
    finally:
        p.close()
    for name, (_, _, reason) in cases.items():
        # The recorded reason is shortened in the middle (paths here are long); the log has it whole.
        assert (reasons[name].startswith("cannot create the instance: ValueError: spec.source: ") and reason
                in reasons[name]) if reason else reasons[name] == "", (name, reasons[name])
    assert f"spec.source: {models}/link.onnx: resolves to {outside}, outside the model roots ({models})" in caplog.text
    assert created == {"inside", "inner-link"}
    assert not (tmp_path / "ran").exists()

    allowed = pool.Pool("n1", rundir, None, Settings(model_roots=(str(models),), allow_model_code=True))
    try:
        allowed.apply([planner.Desired("code", "code", "code", "n1", Tier.COLD)], {"code": specs["code"]})
        assert set(allowed.slots) == {"code"} and not allowed.failed
    finally:
        allowed.close()


def test_volga_up_defaults_its_model_roots_to_the_spec_folders(tmp_path: pathlib.Path) -> None:
    from volga_agent import cli

    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "a.yaml").write_text("")
    args = cli.build_parser().parse_args(["up", "-f", str(specs / "a.yaml"), "-f", str(tmp_path)])
    settings = cli.settings_from(args)
    assert settings.model_roots == (str(tmp_path), str(specs), str(defaultmodel.default_cache()))
    assert settings.allow_model_code is False
    args = cli.build_parser().parse_args(["up", "--model-root", str(specs), "--allow-model-code"])
    assert cli.settings_from(args).model_roots == (str(specs),) and cli.settings_from(args).allow_model_code


def test_instance_folders_stay_inside_the_pools_roots(models: pathlib.Path, rundir: pathlib.Path) -> None:
    spec = spec_at(str(models / "m.onnx")).spec
    p = pool.Pool("n1", rundir / "work", None)
    try:
        names = ["../escaped", "a/b", "..", "/abs", "ok.name-1"]
        p.apply([planner.Desired(name, "m", "m", "n1", Tier.COLD) for name in names], {"m": spec})
        assert set(p.slots) == {"ok.name-1"}
        for name in names[:-1]:
            assert p.failed[name].startswith(f"ValueError: instance name {name!r}: must be a DNS-1123"), p.failed[name]
    finally:
        p.close()
    assert not (rundir / "escaped").exists() and not (rundir / "work" / "a").exists()


# --- caps ----------------------------------------------------------------------------------------------------------


def test_node_defaults_come_from_the_machine() -> None:
    total = admission.mem_total()
    meminfo = dict(line.split(":", 1) for line in pathlib.Path("/proc/meminfo").read_text().splitlines())
    assert total == int(meminfo["MemTotal"].split()[0]) * 1024 > 0
    settings = admission.node_settings(Settings(), total=64 * 2**30)
    assert settings.budgets.host_memory_bytes == int(0.8 * 64 * 2**30) and settings.max_instances == 256
    kept = admission.node_settings(Settings(host_memory_budget_bytes=2**30, max_instances=7), total=2**40)
    assert (kept.budgets.host_memory_bytes, kept.max_instances) == (2**30, 7)
    none = admission.node_settings(Settings(host_memory_fraction=0), total=2**40)
    assert none.budgets.host_memory_bytes == 0


def test_the_pool_starts_no_more_instances_than_the_cap(models: pathlib.Path, rundir: pathlib.Path) -> None:
    spec = spec_at(str(models / "m.onnx")).spec
    p = pool.Pool("n1", rundir, None, Settings(max_instances=2))
    try:
        p.apply([planner.Desired(f"m-{i}", "m", "m", "n1", Tier.COLD) for i in range(3)], {"m": spec})
        assert sorted(p.slots) == ["m-0", "m-1"]
        assert p.failed == {"m-2": "ValueError: settings.max_instances: this node runs at most 2 instances"}
    finally:
        p.close()


# --- tokens --------------------------------------------------------------------------------------------------------


def test_tokens_files_and_headers() -> None:
    tokens = auth.Tokens((b"abc", b"def"))
    assert tokens.accepts("Bearer abc") and tokens.accepts("bearer def") and tokens.accepts("  Bearer  abc ")
    for header in (None, "", "abc", "Bearer", "Bearer ab", "Bearer abcd", "Basic abc"):
        assert not tokens.accepts(header), header
    with tempfile.NamedTemporaryFile("w") as empty:
        empty.write("# nothing\n\n")
        empty.flush()
        with pytest.raises(ValueError, match="no token in the file"):
            auth.Tokens.from_file(empty.name)
