"""The init a model server's PID namespace runs under (tini, `worker.nsinit --init`): how the command is put under
it, and where the agent finds it."""

from __future__ import annotations

import os
import pathlib

import pytest

from volga_agent.snapshot import criu
from volga_agent.worker import nsinit


def test_the_command_runs_under_the_init_in_the_launchers_folder(tmp_path: pathlib.Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert nsinit.under_init("/opt/criu/bin/tini", ["python", "server.py"]) == [
        "/opt/criu/bin/tini", "-g", "--", "/usr/bin/env", f"--chdir={tmp_path}", "python", "server.py"]


@pytest.mark.parametrize("argv", [["--init"], ["--init", "tini"], ["--init", "tini", "/tmp", "log"]])
def test_an_init_without_its_folder_or_command_is_a_usage_error(argv: list[str],
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert nsinit.main(argv) == 2
    assert "[--init INIT DIR]" in capsys.readouterr().err


def executable(path: pathlib.Path) -> pathlib.Path:
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_tini_is_found_beside_criu_or_where_volga_tini_says(tmp_path: pathlib.Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    monkeypatch.setenv("VOLGA_CRIU_PREFIX", str(tmp_path / "no-prefix"))
    monkeypatch.delenv("VOLGA_TINI", raising=False)
    (tmp_path / "bin").mkdir()
    criu_binary = executable(tmp_path / "bin" / "criu")
    with pytest.raises(criu.CriuError, match=r"tini not found: .*scripts/install-criu\.sh"):
        criu.find_init(str(criu_binary))
    beside = executable(tmp_path / "bin" / "tini")
    assert criu.find_init(str(criu_binary)) == str(beside)
    named = executable(tmp_path / "my-tini")
    monkeypatch.setenv("VOLGA_TINI", str(named))
    assert criu.find_init(str(criu_binary)) == str(named)
    os.chmod(named, 0o644)  # not executable: passed over
    assert criu.find_init(str(criu_binary)) == str(beside)
