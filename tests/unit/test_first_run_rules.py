"""What a first run with a real model decides before anything starts: model files outside the model roots stop
`volga up` once, naming each ModelSpec, the roots, the flag and the setting (and `volga validate` says the same);
a model file that does not parse refuses its model alone; the gateway answers a refused model UNAVAILABLE with the
reason; a model whose instances could not be created is UNAVAILABLE with why, not unknown. Real ONNX files, no
process. Served as a user runs it: tests/integration/test_first_run.py."""

from __future__ import annotations

import asyncio
import inspect
import pathlib
from typing import Any

import onnx
import pytest
import yaml
from onnx import TensorProto, helper
from specs import spec_at

from volga_agent import cli, errors
from volga_agent.app import defaultmodel
from volga_agent.gateway import catalog, dataplane, links, oip
from volga_agent.node import admission, pool, signature
from volga_agent.node.settings import Settings
from volga_core import api, planner


def relu(path: pathlib.Path) -> pathlib.Path:
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def document(name: str, source: pathlib.Path, **fields: Any) -> dict[str, Any]:
    """A ModelSpec that leaves its signature out, as a user writes one: read from the model file."""
    return {"apiVersion": api.API_VERSION, "kind": "ModelSpec", "metadata": {"name": name},
            "spec": {"modelId": name, "framework": "onnx", "source": f"file://{source}", **fields}}


def write(path: pathlib.Path, *documents: dict[str, Any]) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump_all(documents))
    return path


@pytest.fixture
def apart(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """specs/m.yaml for models/m.onnx: the model file in another folder than its ModelSpec."""
    (tmp_path / "models").mkdir()
    model = relu(tmp_path / "models" / "m.onnx")
    write(tmp_path / "specs" / "m.yaml", document("m", model))
    return tmp_path / "specs", tmp_path / "models"


# --- model roots ---------------------------------------------------------------------------------------------------


def test_outside_roots_finds_model_files_outside_and_through_links(tmp_path: pathlib.Path) -> None:
    inside, elsewhere = tmp_path / "in", tmp_path / "out"
    inside.mkdir()
    elsewhere.mkdir()
    relu(inside / "a.onnx")
    relu(elsewhere / "b.onnx")
    (inside / "link.onnx").symlink_to(elsewhere / "b.onnx")
    labelled = [(f"{name}.yaml", spec_at(str(source), name)) for name, source in
                (("a", inside / "a.onnx"), ("b", elsewhere / "b.onnx"), ("link", inside / "link.onnx"),
                 ("missing", elsewhere / "nope.onnx"))]
    found = admission.outside_roots(labelled, [str(inside)])
    assert [(o.label, o.name) for o in found] == [("b.yaml", "b"), ("link.yaml", "link")]
    assert found[0].problem == ("spec.source", f"{elsewhere / 'b.onnx'}: the model file {elsewhere / 'b.onnx'} is "
                                               "outside the model roots")
    assert found[1].problem[1] == (f"{inside / 'link.onnx'}: the model file {inside / 'link.onnx'}, which resolves "
                                   f"to {elsewhere / 'b.onnx'}, is outside the model roots")
    assert admission.outside_roots(labelled, []) == []  # no roots: anywhere


def test_outside_roots_names_a_servers_folder_and_working_folder(tmp_path: pathlib.Path) -> None:
    inside, elsewhere = tmp_path / "in", tmp_path / "out"
    (inside / "app").mkdir(parents=True)
    elsewhere.mkdir()

    def server(name: str, source: pathlib.Path, working_dir: pathlib.Path | None = None) -> api.ModelSpec:
        fields: dict[str, object] = {"command": ["python", "-m", "app", "--port", "{port}"]}
        if working_dir is not None:
            fields["workingDir"] = str(working_dir)
        return api.parse_model_spec({"apiVersion": api.API_VERSION, "kind": "ModelSpec", "metadata": {"name": name},
                                     "spec": {"modelId": name, "framework": "server", "source": str(source),
                                              "server": fields}})

    labelled = [("a.yaml", server("a", inside / "app", inside / "app")), ("b.yaml", server("b", elsewhere)),
                ("c.yaml", server("c", inside / "app", elsewhere))]
    found = admission.outside_roots(labelled, [str(inside)])
    assert [(o.name, o.problem) for o in found] == [
        ("b", ("spec.source", f"{elsewhere}: the server's source {elsewhere} is outside the model roots")),
        ("c", ("spec.server.workingDir", f"{elsewhere}: the server's working folder {elsewhere} is outside the model "
                                         "roots"))]


def test_volga_up_stops_once_at_the_start_naming_the_flag_and_the_setting(
        apart: tuple[pathlib.Path, pathlib.Path], capsys: pytest.CaptureFixture[str]) -> None:
    specs, models = apart
    assert cli.main(["up", "-f", str(specs), "--agent-port", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("volga up: 1 ModelSpec names a model file outside the model roots; nothing was started:\n")
    assert (f"  {specs / 'm.yaml'}: ModelSpec m: spec.source: file://{models / 'm.onnx'}: the model file "
            f"{models / 'm.onnx'} is outside the model roots\n") in err
    assert (f"  the model roots: {specs}, {defaultmodel.default_cache()} (the default: the folders of the ModelSpec "
            "files and the built-models cache)") in err
    assert "`volga up --model-root DIR` (repeatable" in err and "the setting settings.model_roots" in err
    assert err.count("outside the model roots") == 1 + 1  # the header and the one ModelSpec: once, not per instance


def test_the_settings_file_gives_the_model_roots_unless_the_flag_does(tmp_path: pathlib.Path) -> None:
    settings = tmp_path / "settings.yaml"
    settings.write_text("modelRoots: [/srv/models]\n")
    args = cli.build_parser().parse_args(["up", "-f", str(tmp_path), "--settings", str(settings)])
    assert cli.settings_from(args).model_roots == ("/srv/models",)
    assert cli.roots_origin(args, ("/srv/models",)) == "from settings.model_roots"
    args = cli.build_parser().parse_args(["up", "--settings", str(settings), "--model-root", str(tmp_path)])
    assert cli.settings_from(args).model_roots == (str(tmp_path),)
    args = cli.build_parser().parse_args(["up", "-f", str(tmp_path), "--set", "model_roots=[/a]"])
    assert cli.settings_from(args).model_roots == ("/a",)


def test_validate_holds_sources_to_the_roots_volga_up_would_use(
        apart: tuple[pathlib.Path, pathlib.Path], capsys: pytest.CaptureFixture[str]) -> None:
    specs, models = apart
    assert cli.main(["validate", "-f", str(specs)]) == 1
    err = capsys.readouterr().err
    assert (f"{specs / 'm.yaml'}: ModelSpec m: invalid\n  spec.source: file://{models / 'm.onnx'}: the model file "
            f"{models / 'm.onnx'} is outside the model roots\n") in err
    assert f"the model roots: {specs}, {defaultmodel.default_cache()}" in err
    assert "`volga up --model-root DIR`" in err and "settings.model_roots" in err
    assert cli.main(["validate", "-f", str(specs), "--model-root", str(models)]) == 0
    assert "ModelSpec m (m, onnx) is valid" in capsys.readouterr().out
    assert cli.main(["validate", "--schema-only", "-f", str(specs)]) == 0  # the files are not opened


# --- one model file that does not parse ----------------------------------------------------------------------------


@pytest.fixture
def mixed(tmp_path: pathlib.Path) -> pathlib.Path:
    """good.yaml beside bad.yaml, whose model file is garbage bytes."""
    (tmp_path / "bad.onnx").write_bytes(bytes(range(256)) * 3)
    write(tmp_path / "good.yaml", document("good", relu(tmp_path / "good.onnx")))
    write(tmp_path / "bad.yaml", document("bad", tmp_path / "bad.onnx"))
    return tmp_path


def test_load_refuses_the_model_whose_file_does_not_parse_and_keeps_the_others(mixed: pathlib.Path) -> None:
    loaded = signature.load([str(mixed)])
    assert [(label, s.metadata.name) for label, s in loaded.labelled] == [(str(mixed / "good.yaml"), "good")]
    assert [t.name for t in loaded.specs[0].spec.inputs] == ["x"]
    [refused] = loaded.refused
    assert (refused.label, refused.model_id) == (str(mixed / "bad.yaml"), "bad")
    assert refused.reason.startswith(f"spec.source: {mixed / 'bad.onnx'} is not an ONNX model: ")
    # Without keep_going (the agent's static mode), the first refusal is raised, as before.
    with pytest.raises(api.SpecError) as caught:
        signature.load_files([str(mixed)])
    assert caught.value.source == str(mixed / "bad.yaml")


def test_a_chain_with_a_refused_model_is_refused_whole(mixed: pathlib.Path) -> None:
    write(mixed / "head.yaml", document("head", mixed / "good.onnx", chain=["bad"]))
    loaded = signature.load([str(mixed)])
    assert [s.metadata.name for s in loaded.specs] == ["good"]
    assert {r.model_id: r.error.problems[0][0] for r in loaded.refused} == {"bad": "spec.source",
                                                                            "head": "spec.chain"}
    head = next(r for r in loaded.refused if r.model_id == "head")
    assert f"it is in a chain with model 'bad' ({mixed / 'bad.yaml'}), which cannot be served: spec.source" \
        in head.reason


def test_what_is_no_single_models_problem_still_stops_it(mixed: pathlib.Path) -> None:
    write(mixed / "again.yaml", document("good", mixed / "good.onnx"))
    with pytest.raises(api.SpecError, match="already used by the ModelSpec"):
        signature.load([str(mixed)])
    (mixed / "again.yaml").write_text("kind: [")
    with pytest.raises(api.SpecError):
        signature.load([str(mixed)])


def test_volga_up_exits_2_when_nothing_is_left_to_serve(mixed: pathlib.Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    (mixed / "good.yaml").unlink()
    assert cli.main(["up", "-f", str(mixed), "--agent-port", "-1"]) == 2
    err = capsys.readouterr().err
    assert f"volga up: {mixed / 'bad.yaml'}: ModelSpec bad (model 'bad') cannot be served:\n  spec.source: " in err
    assert err.rstrip().endswith("volga up: no ModelSpec is left to serve")


def test_the_gateway_answers_a_refused_model_unavailable_with_the_reason() -> None:
    good = spec_at("/m/good.onnx", "good").spec
    models = catalog.Catalog({"good": good})
    models.refuse("bad", "1", "its ModelSpec bad (bad.yaml) could not be loaded: spec.source: not ONNX")
    plane = dataplane.Dataplane(models, links.LocalAgentLink(lambda m, h: links.Route("", ""), lambda m: []))
    message = "model 'bad' is unavailable: its ModelSpec bad (bad.yaml) could not be loaded: spec.source: not ONNX"

    async def main() -> None:
        for call in (lambda: plane.model_metadata("bad"), lambda: plane.model_config("bad"),
                     lambda: plane.model_metadata("bad", "1")):
            with pytest.raises(oip.OipError) as caught:
                answer = call()
                if inspect.isawaitable(answer):
                    await answer
            assert (caught.value.code, caught.value.http_status, caught.value.message) == ("UNAVAILABLE", 503,
                                                                                          message)
        assert not await plane.model_ready("bad")
        index = {m.name: m for m in await plane.repository_index()}
        assert (index["bad"].state, index["bad"].version) == ("UNAVAILABLE", "1")
        assert index["bad"].reason == message.removeprefix("model 'bad' is unavailable: ")

        async def never() -> None:
            raise AssertionError("a refused model's request is answered before its body is read")

        with pytest.raises(oip.OipError) as caught:
            await plane.observe("bad", "grpc", never)
        assert (caught.value.code, caught.value.message) == ("UNAVAILABLE", message)
        sample = plane.metrics.registry.get_sample_value
        assert sample("volga_gateway_requests_total", {"model": "bad", "protocol": "grpc", "code": "UNAVAILABLE"}) == 1
        with pytest.raises(oip.OipError) as caught:
            await plane.observe("nope", "grpc", lambda: plane.infer("nope", {}, {}))
        assert caught.value.code == "NOT_FOUND"  # a name nobody gave is still unknown
        await plane.close()

    asyncio.run(main())


# --- a model whose instances could not be created ------------------------------------------------------------------


def test_a_model_whose_instances_could_not_be_created_is_unavailable_with_why(models: pathlib.Path,
                                                                              rundir: pathlib.Path) -> None:
    spec = spec_at("/etc/passwd", "passwd").spec
    p = pool.Pool("n1", rundir, None, Settings(model_roots=(str(models),)))
    try:
        p.apply([planner.Desired("passwd-0", "passwd", "passwd", "n1", api.Tier.COLD)], {"passwd": spec})
        assert not p.slots and "passwd-0" in p.failed
        with pytest.raises(errors.ActivationFailed) as caught:
            p.activate("passwd")
        assert str(caught.value).startswith("no instance of model 'passwd' could be created on node n1: passwd-0: "
                                            "ValueError: spec.source: /etc/passwd: resolves to /etc/passwd, outside "
                                            "the model roots")
        assert "(volga up --model-root DIR)" in str(caught.value)
        with pytest.raises(errors.UnknownModel, match="no instance of model 'other'"):
            p.activate("other")
    finally:
        p.close()
