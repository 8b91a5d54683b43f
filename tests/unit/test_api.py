from __future__ import annotations

import copy
import pathlib

import pytest
import yaml

from volga_agent import cli
from volga_agent.app import defaultmodel
from volga_agent.node import signature
from volga_core import api


@pytest.fixture
def document() -> dict:
    # The embedded default model's real file: validation opens it.
    return defaultmodel.spec_document(defaultmodel.ensure().spec.source_path)


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


@pytest.mark.parametrize("source", ["s3://bucket/model.onnx", "s3://bucket/models/resnet/",
                                    "https://models.example.com/resnet.onnx", "http://127.0.0.1:8080/m.onnx",
                                    "oci://registry.example.com:5000/models/resnet:v1",
                                    "oci://localhost/models/resnet@sha256:" + "a" * 64])
def test_remote_sources_accepted(document: dict, source: str) -> None:
    document["spec"]["source"] = source
    document["spec"]["sourceDigest"] = "sha256:" + "0" * 64
    document["spec"]["sourceSecret"] = "model-store"
    spec = api.parse_model_spec(document).spec
    assert spec.remote_source and spec.source == source and spec.source_digest == "sha256:" + "0" * 64


@pytest.mark.parametrize(("source", "reason"), [
    ("s3://bucket", "s3://bucket/key"), ("ftp://host/m.onnx", "unknown scheme ftp://"),
    ("https://host/models/", "a folder cannot be listed over HTTP"),
    ("oci://registry/Models:v1", "oci://registry/repository:tag")])
def test_malformed_remote_sources_rejected(document: dict, source: str, reason: str) -> None:
    document["spec"]["source"] = source
    assert reason in dict(problems(document))["spec.source"]


def test_source_digest_must_be_sha256(document: dict) -> None:
    document["spec"]["sourceDigest"] = "md5:abc"
    assert "sha256: and 64 lowercase hex" in dict(problems(document))["spec.sourceDigest"]


def test_remote_source_is_not_made_relative(tmp_path: pathlib.Path, document: dict) -> None:
    document["spec"]["source"] = "s3://bucket/model.onnx"
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(document))
    assert api.load_model_specs(tmp_path / "spec.yaml")[0].spec.source == "s3://bucket/model.onnx"


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


def found_at(doc: dict) -> dict[str, str]:
    return dict(problems(doc))


def test_dims_are_positive_integers_or_minus_one(document: dict) -> None:
    document["spec"]["inputs"][0]["shape"] = [True, 13]
    assert "boolean" in found_at(document)["spec.inputs[0].shape[0]"]
    document["spec"]["inputs"][0]["shape"] = [None, 13]
    assert "write -1 for a dimension of any size" in found_at(document)["spec.inputs[0].shape[0]"]
    document["spec"]["inputs"][0]["shape"] = ["batch", 13]
    assert "write -1" in found_at(document)["spec.inputs[0].shape[0]"]
    for big in (10**12, 2**70, 2**31):
        document["spec"]["inputs"][0]["shape"] = [-1, big]
        assert "at most 2147483647" in found_at(document)["spec.inputs[0].shape"]
    document["spec"]["inputs"][0]["shape"] = [-1, 2**31 - 1]
    assert api.parse_model_spec(document).spec.inputs[0].shape == [-1, 2**31 - 1]


@pytest.mark.parametrize("name", ["a\x00b", "tab\there", "new\nline", "x\u202eevil", "\u2066iso", "del\x7f"])
def test_tensor_names_without_control_or_bidi_characters(document: dict, name: str) -> None:
    document["spec"]["outputs"][0]["name"] = name
    assert "control characters" in found_at(document)["spec.outputs[0].name"]


@pytest.mark.parametrize("name", ["/etc/passwd", "../..", "..", "Upper", "a_b", "-a", "a" * 64, "a/b"])
def test_names_and_model_ids_are_dns_names(document: dict, name: str) -> None:
    document["metadata"]["name"] = name
    document["spec"]["modelId"] = name
    found = found_at(document)
    assert "DNS-1123" in found["metadata.name"] and "DNS-1123" in found["spec.modelId"]


def test_dns_names_accepted(document: dict) -> None:
    document["metadata"]["name"] = "a" * 63
    document["spec"]["modelId"] = "resnet-50.v2"
    assert api.parse_model_spec(document).spec.model_id == "resnet-50.v2"


def test_pool_floors_are_capped(document: dict) -> None:
    document["spec"]["pool"] = {"hot": 65, "frozen": True}
    found = found_at(document)
    assert "65 is more than 64" in found["spec.pool.hot"]
    assert "boolean" in found["spec.pool.frozen"]
    document["spec"]["pool"] = {"hot": 64, "warm": 64, "suspended": 64, "frozen": 64}
    assert api.parse_model_spec(document).spec.pool.floor(api.Tier.HOT) == 64


def test_onnx_signature_may_be_left_out(document: dict) -> None:
    del document["spec"]["inputs"], document["spec"]["outputs"]
    spec = api.parse_model_spec(document)
    assert not spec.spec.has_signature and spec.spec.input_hash() == ""
    wire = spec.to_wire()
    assert "inputs" not in wire["spec"] and "outputs" not in wire["spec"]
    assert api.parse_model_spec(wire) == spec  # written back, read back
    spec, problem = api.validate_spec(wire["spec"])
    assert problem == "" and spec is not None and spec.inputs == []


@pytest.mark.parametrize("framework", ["torchscript", "pytorch"])
def test_other_frameworks_must_write_their_signature(document: dict, framework: str) -> None:
    document["spec"]["framework"] = framework
    del document["spec"]["outputs"]
    assert "carries no tensor signature" in found_at(document)["spec.outputs"]


def test_fill_reads_the_signature_from_the_onnx_file(document: dict) -> None:
    written = api.parse_model_spec(document).spec
    del document["spec"]["inputs"], document["spec"]["outputs"]
    filled = signature.fill(api.parse_model_spec(document).spec)
    # The default model's batch dimension is symbolic ("batch"): -1 here, as the hand-written spec says.
    assert filled.inputs == written.inputs and filled.outputs == written.outputs
    assert filled.input_hash() == written.input_hash()
    assert signature.check(filled) == []


def test_fill_keeps_a_written_signature_without_opening_the_file(document: dict) -> None:
    document["spec"]["source"] = "/nonexistent/model.onnx"
    spec = api.parse_model_spec(document).spec
    assert signature.fill(spec) is spec


def test_fill_names_a_missing_file(document: dict) -> None:
    document["spec"]["source"] = "/nonexistent/model.onnx"
    del document["spec"]["inputs"]
    with pytest.raises(api.SpecError) as err:
        signature.fill(api.parse_model_spec(document).spec)
    assert err.value.problems == [("spec.source", "model file /nonexistent/model.onnx does not exist")]


def test_check_names_each_mismatch(document: dict) -> None:
    spec = document["spec"]
    spec["inputs"][0]["name"] = "image"
    spec["inputs"][1]["dtype"] = "FP32"
    spec["inputs"][1]["shape"] = [-1, 27]
    spec["outputs"][0]["shape"] = [-1, 1, 1]
    found = signature.check(api.parse_model_spec(document).spec)
    assert ("spec.inputs[0].name", "the model has no input 'image' (it has 'dense', 'sparse')") in found
    assert ("spec.inputs[1].dtype", "the model declares INT64, the spec FP32") in found
    assert ("spec.inputs[1].shape[1]", "the model fixes this dimension at 26, the spec 27") in found
    assert ("spec.outputs[0].shape", "rank 2 in the model, 3 here") in found
    assert any(path == "spec.inputs" and "'dense'" in reason and "missing" in reason for path, reason in found)


def test_check_accepts_any_size_for_symbolic_dims(document: dict) -> None:
    document["spec"]["inputs"][0]["shape"] = [32, 13]  # the model's batch dimension is symbolic
    document["spec"]["inputs"][1]["shape"] = [-1, -1]  # -1 for the model's fixed 26 is fine
    assert signature.check(api.parse_model_spec(document).spec) == []


def test_repeated_names_and_model_ids_name_both_places(document: dict) -> None:
    first = api.parse_model_spec(document)
    document["spec"]["modelId"] = "other"
    same_name = api.parse_model_spec(document)
    errors = api.repeated([("a.yaml", first), ("b.yaml", same_name), ("c.yaml#1", first)])
    assert [e.source for e in errors] == ["b.yaml", "c.yaml#1"]
    assert errors[0].problems == [("metadata.name", "'ctr-default' is already used by the ModelSpec in a.yaml")]
    assert dict(errors[1].problems)["spec.modelId"] == "'ctr-default' is already used by the ModelSpec in a.yaml"
