from __future__ import annotations

import copy
import pathlib

import pytest
import yaml

from volga_agent import cli, defaultmodel
from volga_operator import api


@pytest.fixture
def document(tmp_path: pathlib.Path) -> dict:
    model = tmp_path / "model.onnx"
    model.write_bytes(b"x")
    return defaultmodel.spec_document(model)


def problems(doc: dict) -> list[tuple[str, str]]:
    with pytest.raises(api.SpecError) as err:
        api.parse_model_spec(doc)
    return err.value.problems


def test_default_spec_parses(document: dict) -> None:
    spec = api.parse_model_spec(document)
    assert spec.spec.framework is api.Framework.ONNX
    assert spec.spec.pool.frozen == 1
    assert spec.spec.runtime.reset_rng_on_restore is True
    assert spec.to_wire()["spec"]["modelId"] == "ctr-default"


def test_unknown_field_is_named(document: dict) -> None:
    document["spec"]["runtime"]["warmupIteration"] = 3
    assert ("spec.runtime.warmupIteration", "unknown field") in problems(document)


def test_bad_values_name_the_field_path(document: dict) -> None:
    document["spec"]["inputs"][1]["dtype"] = "INT65"
    document["spec"]["inputs"][0]["shape"] = [0, 13]
    document["spec"]["runtime"]["warmupCacheRatio"] = 1.5
    document["spec"]["modelId"] = "Not Valid!"
    found = dict(problems(document))
    assert "spec.inputs[1].dtype" in found
    assert "dimension 0 is not allowed" in found["spec.inputs[0].shape"]
    assert "less than or equal to 1" in found["spec.runtime.warmupCacheRatio"]
    assert "lowercase" in found["spec.modelId"]


def test_missing_required_fields(document: dict) -> None:
    del document["spec"]["framework"]
    document["spec"]["outputs"] = []
    found = dict(problems(document))
    assert found["spec.framework"] == "Field required"
    assert "at least 1" in found["spec.outputs"]


def test_duplicate_tensor_names_rejected(document: dict) -> None:
    document["spec"]["inputs"].append(copy.deepcopy(document["spec"]["inputs"][0]))
    assert any("repeated: dense" in reason for _, reason in problems(document))


def test_remote_sources_rejected(document: dict) -> None:
    document["spec"]["source"] = "s3://bucket/model.onnx"
    assert "file://" in dict(problems(document))["spec.source"]


def test_slo_keys_are_batch_sizes(document: dict) -> None:
    document["spec"]["slo"] = {"baselineLatencyMs": {"8": 4.0, "big": 9.0}}
    assert "batch size" in dict(problems(document))["spec.slo.baselineLatencyMs"]


def test_not_a_mapping() -> None:
    with pytest.raises(api.SpecError, match="expected a mapping"):
        api.parse_model_spec(["a"])


def test_input_hash_is_stable_and_schema_sensitive(document: dict) -> None:
    a = api.parse_model_spec(document).spec.input_hash()
    assert a == api.parse_model_spec(copy.deepcopy(document)).spec.input_hash()
    document["spec"]["inputs"][0]["shape"] = [-1, 14]
    assert api.parse_model_spec(document).spec.input_hash() != a
    assert len(a) == 64


def test_load_multi_document_and_relative_source(tmp_path: pathlib.Path, document: dict) -> None:
    second = copy.deepcopy(document)
    second["metadata"]["name"] = "other"
    second["spec"]["source"] = "model.onnx"
    path = tmp_path / "specs.yaml"
    path.write_text(yaml.safe_dump_all([document, second]))
    specs = api.load_model_specs(tmp_path)
    assert [s.metadata.name for s in specs] == ["ctr-default", "other"]
    assert specs[1].spec.source_path == tmp_path / "model.onnx"


def test_validate_cli(tmp_path: pathlib.Path, document: dict, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(document))
    assert cli.main(["validate", "-f", str(good)]) == 0
    assert "is valid" in capsys.readouterr().out

    document["spec"]["hardware"] = {"minMemoryGiB": -1}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(document))
    assert cli.main(["validate", "-f", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "spec.hardware.minMemoryGiB: Input should be greater than or equal to 0" in err

    document["spec"]["hardware"] = {}
    document["spec"]["source"] = str(tmp_path / "missing.onnx")
    missing = tmp_path / "missing.yaml"
    missing.write_text(yaml.safe_dump(document))
    assert cli.main(["validate", "-f", str(missing)]) == 1
    assert "spec.source: model file" in capsys.readouterr().err

    broken = tmp_path / "broken.yaml"
    broken.write_text("spec: [unclosed")
    assert cli.main(["validate", "-f", str(broken)]) == 1
    assert "not valid YAML" in capsys.readouterr().err


def test_pool_floor(document: dict) -> None:
    spec = api.parse_model_spec(document).spec
    assert spec.pool.floor(api.Tier.FROZEN) == 1
    assert spec.pool.floor(api.Tier.COLD) == 0
