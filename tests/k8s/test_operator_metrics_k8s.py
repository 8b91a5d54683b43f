"""The operator's `/metrics` behind a bearer token (docs/security.md): the real `volga-operator` process against a
real kube-apiserver + etcd, with `--metrics-token-file` or VOLGA_METRICS_TOKEN_FILE, answers 401 with
`WWW-Authenticate: Bearer realm="volga"` to a scrape without a token or with a wrong one, and its metrics to one
that carries a token of the file; without a token file the endpoint stays open, as before."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest
from procs import Daemon, families, scrape, wait_for

from volga_bench.controlplane import ControlPlane, free_ports
from volga_operator import loop

pytest_plugins = ["k8s_fixtures"]
TOKEN = "operator-scrape-token"


@pytest.mark.parametrize("given", ["flag", "env", "none"])
def test_the_operators_metrics_want_a_token(given: str, control_plane: ControlPlane, crds: None,
                                            tmp_path: pathlib.Path) -> None:
    token_file = tmp_path / "tokens"
    token_file.write_text(f"# one token a line\n{TOKEN}\nanother-token\n")
    [port] = free_ports(1)
    env = {**os.environ, "KUBECONFIG": str(control_plane.kubeconfig)}
    env.pop("VOLGA_METRICS_TOKEN_FILE", None)
    command = [sys.executable, "-m", "volga_operator", "--liveness", "", "--metrics-port", str(port)]
    if given == "flag":
        command += ["--metrics-token-file", str(token_file)]
    elif given == "env":
        env["VOLGA_METRICS_TOKEN_FILE"] = str(token_file)
    operator = Daemon("operator", command, env, tmp_path)
    try:
        # Started whole (watches listed, one planning pass), so that stopping it is an ordinary stop.
        wait_for("the operator's first pass", lambda: loop.FIRST_PASS_DONE in operator.log.read_text(),
                 timeout=120)
        status, headers, body = scrape(port)
        if given == "none":
            assert status == 200 and "volga_operator_writes" in families(body), (status, body[:500])
            return
        for token in (None, "wrong", TOKEN + "x", ""):
            status, headers, body = scrape(port, token)
            assert status == 401 and headers["WWW-Authenticate"] == 'Bearer realm="volga"', (token, status, body)
            assert "volga_operator" not in body and "a bearer token is required" in body
        for token in (TOKEN, "another-token"):
            status, _, body = scrape(port, token)
            assert status == 200 and "volga_operator_writes" in families(body), (token, status, body[:500])
    finally:
        assert operator.stop() == 0, operator.log.read_text()[-3000:]
