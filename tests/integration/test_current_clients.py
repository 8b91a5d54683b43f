"""Volga installs beside the clients users bring today: the newest releases of tritonclient, KServe and grpcio on
the package index resolve together with Volga and its extras. A pin that shuts out a current release (as
`grpcio<1.68` once did, for a tritonclient of 2024) fails here, in CI, the day that release appears."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLIENTS = ("tritonclient", "kserve", "grpcio")

pytestmark = pytest.mark.slow


def newest(name: str) -> str:
    """The newest release of `name` on the index pip is configured with."""
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", name], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    found = re.match(rf"{re.escape(name)} \(([^)]+)\)", out.stdout)
    assert found, out.stdout
    return found[1]


def test_the_newest_clients_resolve_with_volga_and_its_extras(tmp_path: pathlib.Path) -> None:
    wanted = {name: newest(name) for name in CLIENTS}
    report = tmp_path / "resolution.json"
    pins = [f"tritonclient[grpc,http]=={wanted['tritonclient']}", f"kserve=={wanted['kserve']}",
            f"grpcio=={wanted['grpcio']}"]
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
                          "--report", str(report), f"{ROOT}[test,bench,peers]", *pins],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, f"Volga's requirements shut out a current release of {wanted}:\n{out.stderr[-3000:]}"
    resolved = {item["metadata"]["name"].lower(): item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}
    assert {name: resolved[name] for name in CLIENTS} == wanted
