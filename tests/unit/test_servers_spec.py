"""A ModelSpec naming a model server (`framework: server`): what it accepts and the errors that name the field."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

from volga_core import api
from volga_core.api import servers


def parse(server: dict[str, Any] | None, framework: str = "server") -> api.ModelSpecSpec:
    body: dict[str, Any] = {"modelId": "srv", "framework": framework, "source": "/srv"}
    if server is not None:
        body["server"] = server
    if framework != "server":
        body |= {"inputs": [{"name": "x", "dtype": "FP32", "shape": [-1]}],
                 "outputs": [{"name": "y", "dtype": "FP32", "shape": [-1]}]}
    return api.ModelSpecSpec.model_validate(body)


def error(server: dict[str, Any] | None, framework: str = "server") -> tuple[tuple[Any, ...], str]:
    with pytest.raises(pydantic.ValidationError) as caught:
        parse(server, framework)
    first = caught.value.errors()[0]
    return tuple(first["loc"]), first["msg"]


def test_defaults_and_wire_names() -> None:
    spec = parse({"command": ["python", "-m", "app", "--port", "{port}"],
                  "hooks": {"signalFiles": True, "beforeCheckpoint": [{"path": "/sleep?level=1"}]},
                  "canary": {"path": "/v1/x", "body": "{}", "expect": "ok"}})
    assert spec.server is not None and not spec.has_signature
    assert spec.server.protocol is api.Protocol.HTTP and spec.server.listen is api.Listen.PORT
    assert spec.server.connections is api.Connections.REFUSE
    assert spec.server.hooks.before_checkpoint[0].method == "POST"
    wire = spec.to_wire()["server"]
    assert wire["hooks"]["signalFiles"] is True and wire["readiness"]["path"] == "/"
    assert api.ModelSpecSpec.model_validate(spec.to_wire()) == spec


@pytest.mark.parametrize(("server", "framework", "loc", "words"), [
    (None, "server", ("server",), "framework: server needs server"),
    ({"command": ["x"]}, "onnx", ("framework",), "write framework: server"),
    ({"command": []}, "server", ("server", "command"), "at least 1"),
    ({"command": ["x", "{socket}"]}, "server", ("server",), "listen is port"),
    ({"command": ["x", "{port}"], "listen": "unix"}, "server", ("server",), "listen is unix"),
    ({"command": ["x"], "listen": "unix", "protocol": "oip-grpc"}, "server", ("server",), "oip-grpc"),
    ({"command": ["x"], "env": {"1BAD": "v"}}, "server", ("server", "env"), "'1BAD'"),
    ({"command": ["x"], "env": {"VOLGA_SIGNAL_DIR": "v"}}, "server", ("server", "env"), "set by Volga"),
    ({"command": ["x"], "readiness": {"path": "health"}}, "server", ("server", "readiness", "path"), "starts with '/'"),
    ({"command": ["x"], "hooks": {"afterRestore": [{"path": "/w", "method": "DELETE"}]}}, "server",
     ("server", "hooks", "afterRestore", 0, "method"), "GET|POST|PUT"),
    ({"command": ["x"], "hooks": {"beforeCheckpoint": [{"path": "/sleep?level=1"}],
                                  "beforeFreeze": [{"path": "/sleep?level=2"}]}}, "server", ("server", "hooks"),
     "beforeFreeze: a server asleep through beforeCheckpoint is woken by the afterRestore hooks"),
    ({"command": ["x"], "hooks": {"signalFiles": True, "beforeFreeze": [{"path": "/sleep?level=2"}]}}, "server",
     ("server", "hooks"), "with signalFiles the image is taken once"),
    ({"command": ["x"], "canary": {"path": "/x", "compare": ["choices..text"]}}, "server",
     ("server", "canary", "compare", 0), "should match pattern"),
    ({"command": ["x"], "canary": {"path": "/x", "compare": ["choices"], "expect": "ok"}}, "server",
     ("server", "canary"), "expect: with compare, the expected answer is JSON"),
    ({"command": ["x"], "protocol": "grpc"}, "server", ("server", "protocol"), "oip-http"),
    ({"command": ["x", "{port}"], "protocol": "oip-grpc"}, "server", ("server",), "write {grpc_port}"),
    ({"command": ["x", "{grpc_port}"], "protocol": "oip-http"}, "server", ("server",), "only protocol: oip-grpc"),
    ({"command": ["x"], "connections": "keep"}, "server", ("server", "connections"), "'refuse' or 'close'"),
])
def test_errors_name_the_field(server: dict[str, Any] | None, framework: str, loc: tuple[Any, ...],
                               words: str) -> None:
    where, message = error(server, framework)
    assert where == loc
    assert words in message


def test_an_oip_grpc_server_is_told_its_grpc_port_and_reported_with_it() -> None:
    spec = parse({"command": ["kserve", "--http_port", "{port}"], "env": {"GRPC": "{grpc_port}"},
                  "protocol": "oip-grpc"})
    assert spec.server is not None and spec.server.protocol is api.Protocol.OIP_GRPC
    both = api.listen_address("http://127.0.0.1:8080", "127.0.0.1:9090")
    assert api.split_address(both) == ("http://127.0.0.1:8080", "127.0.0.1:9090")
    assert api.split_address(api.listen_address("unix:/run/v/server.sock")) == ("unix:/run/v/server.sock", "")


def test_a_server_source_is_on_the_node_or_fetched_its_working_folder_inside_it() -> None:
    def spec(source: str, working: str | None = None) -> api.ModelSpecSpec:
        server: dict[str, object] = {"command": ["x"], **({"workingDir": working} if working else {})}
        return api.ModelSpecSpec.model_validate({"modelId": "srv", "framework": "server", "source": source,
                                                 "server": server})

    assert spec("s3://bucket/app/", "src").remote_source
    assert spec("/models/app", "/srv/elsewhere").server is not None
    for source, working, words in (("s3://bucket/app/", "/srv/app", "relative to the source's top"),
                                   ("oci://registry/app:v1", "../up", "no '..'"),
                                   ("/models/app", "src/../../up", "no '..'")):
        with pytest.raises(pydantic.ValidationError) as caught:
            spec(source, working)
        first = caught.value.errors()[0]
        assert first["loc"] == ("server", "workingDir") and words in first["msg"], first


def test_a_canarys_compared_fields_are_found_by_name_and_index() -> None:
    body = b'{"id": "cmpl-1", "choices": [{"text": "volga", "index": 0}], "usage": {"tokens": 1}}'
    assert servers.json_fields(body, ["choices.0.text", "usage", "choices"]) == {
        "choices.0.text": "volga", "usage": {"tokens": 1}, "choices": [{"text": "volga", "index": 0}]}
    with pytest.raises(ValueError, match=r"no field choices.1.text \(at '1'\)"):
        servers.json_fields(body, ["choices.1.text"])
    with pytest.raises(ValueError, match=r"no field id.text \(at 'text'\)"):
        servers.json_fields(body, ["id.text"])
    with pytest.raises(ValueError, match="not JSON"):
        servers.json_fields(b"volga", ["choices"])


def test_a_canary_compares_its_fields_or_the_whole_body() -> None:
    before = b'{"id": "cmpl-1", "created": 1, "choices": [{"text": "volga"}]}'
    fields = api.Canary.model_validate({"path": "/v1/completions", "compare": ["choices"]})
    assert fields.differs(b'{"id": "cmpl-2", "created": 2, "choices": [{"text": "volga"}]}', before) == ""
    assert fields.differs(b'{"id": "cmpl-2", "choices": [{"text": "oka"}]}', before) == (
        "choices is [{'text': 'oka'}], expected [{'text': 'volga'}]")
    whole = api.Canary.model_validate({"path": "/v1/completions"})
    assert whole.differs(before, before) == ""
    assert whole.differs(before.replace(b"cmpl-1", b"cmpl-2"), before).startswith("b'{\"id\": \"cmpl-2\"")
