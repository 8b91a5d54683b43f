"""Where a node lets a model server run (`serverpool.check_source`): only with model code allowed, and only from
its model roots; each refusal names the field and the reason."""

from __future__ import annotations

import pathlib

import pytest

from volga_agent.node import serverpool
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
