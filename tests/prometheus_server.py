"""A real Prometheus server for the tests (Debian's `prometheus` package, installed by scripts/install-tools.sh):
started on loopback with its data in a folder, asked with instant PromQL queries."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import pytest
import yaml
from procs import wait_for

from volga_bench.controlplane import free_ports


def prometheus_binary() -> str:
    found = shutil.which("prometheus") or ("/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK) else "")
    if not found:
        pytest.fail("the prometheus server is not installed: apt-get install -y --no-install-recommends prometheus "
                    "(scripts/install-tools.sh does it)", pytrace=False)
    return found


class Prometheus:
    """A Prometheus server on loopback scraping one target (or what `scrape_configs` name) every second, its data
    and log in a folder."""

    def __init__(self, folder: pathlib.Path, target: str = "", scrape_configs: list[dict[str, Any]] | None = None
                 ) -> None:
        (port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{port}"
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": scrape_configs or [{"job_name": "volga", "static_configs": [{"targets": [target]}]}],
        }
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = folder / "prometheus.log"
        self.proc = subprocess.Popen(
            [prometheus_binary(), f"--config.file={folder / 'prometheus.yml'}",
             f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT, cwd=folder,
        )
        try:
            wait_for("prometheus to be ready", self._ready, timeout=60)
        except AssertionError:
            self.stop()
            raise AssertionError(f"prometheus did not start:\n{self.log.read_text()[-3000:]}") from None

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
        with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
            return resp.status == 200

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query; the `vector` result, or an AssertionError carrying Prometheus's error."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{promql}: HTTP {exc.code} {exc.read().decode(errors='replace')}") from None
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def scalar(self, promql: str) -> float | None:
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
