"""Model servers that know nothing of Volga (`framework: server`), frozen by CRIU and woken by a request through
the gateway's proxy: KServe's ModelServer with custom pre/post-processing, a FastAPI app streaming its answer,
a server using the checkpoint handshake, an OIP gRPC server streaming several answers per request (through the
gateway's ModelStreamInfer), and one CRIU cannot dump (refused, named)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import pathlib
import queue
import shutil
import socketserver
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp import web

# Found, not imported: KServe's protos would clash in this process with the gateway's own OIP protos.
if not all(importlib.util.find_spec(name) for name in ("kserve", "fastapi", "uvicorn")):
    pytest.skip("KServe, FastAPI and uvicorn come with the peers extra (make setup)", allow_module_level=True)

from procs import huge_tmpfs_unavailable, tiers, wait_for
from servers import device_copy_server

from volga_agent.autonomy import decider, loop
from volga_agent.gateway import app, catalog, links, proxy
from volga_agent.host import process, tmpfs
from volga_agent.node import instance, server
from volga_agent.snapshot import criu, cuda
from volga_core import api

ROOT = pathlib.Path(__file__).resolve().parents[2]
STREAM = ["-m", "uvicorn", "volga_bench.servers.stream_app:app", "--no-access-log", "--loop", "asyncio"]
KSERVE = ["-m", "volga_bench.servers.kserve_scorer", "--http_port", "{port}", "--enable_grpc", "false",
          "--model_name", "scorer", "--configure_logging", "false"]
ROWS = {"instances": [[float(i * j % 7) for i in range(16)] for j in range(1, 4)]}


def spec(model_id: str, command: list[str], **server_fields: Any) -> api.ModelSpecSpec:
    return api.ModelSpecSpec.model_validate({"modelId": model_id, "framework": "server", "source": str(ROOT),
                                             "server": {"command": [sys.executable, *command], **server_fields}})


@pytest.fixture
def engine() -> Iterator[criu.CriuEngine]:
    try:
        binary = criu.find_criu()
    except criu.CriuError as exc:
        pytest.skip(str(exc))
    folder = pathlib.Path(tempfile.mkdtemp(prefix="volga-servers-", dir="/dev/shm"))
    engine = criu.CriuEngine(folder, criu=binary)
    if tuple(int(p) for p in engine.version().split()[-1].split(".")[:2]) < (4, 2):
        shutil.rmtree(folder, ignore_errors=True)
        pytest.skip(f"{binary} is CRIU {engine.version()}: servers on TCP ports need 4.2 or newer (make criu)")
    yield engine
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def workdir() -> Iterator[pathlib.Path]:
    folder = pathlib.Path(tempfile.mkdtemp(prefix="vsrv-"))  # short: a Unix socket path is at most 107 bytes
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


async def _gateway(fleet: server.Fleet) -> AsyncIterator[str]:
    runner = web.AppRunner(proxy.app(fleet, max_request_bytes=1 << 20))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _run(fleet: server.Fleet, exchange: Any) -> Any:
    async def main() -> Any:
        async for url in _gateway(fleet):
            async with aiohttp.ClientSession() as session:
                return await exchange(session, url)
    return asyncio.run(main())


async def _stream(session: aiohttp.ClientSession, url: str, model: str) -> tuple[int, list[bytes]]:
    """The events of a streamed answer, as the chunks they arrived in."""
    async with session.post(f"{url}/v1/stream", json={"prompt": "volga", "tokens": 6, "delay_ms": 30},
                            headers={"x-model-id": model}) as r:
        chunks = [chunk async for chunk in r.content.iter_any()]
        return r.status, chunks


@pytest.mark.parametrize("listen", ["port", "unix"])
def test_fastapi_stream_frozen_and_woken_by_a_request(engine: criu.CriuEngine, workdir: pathlib.Path,
                                                      listen: str) -> None:
    where = ["--port", "{port}"] if listen == "port" else ["--uds", "{socket}"]
    s = server.ServerInstance(spec("stream", [*STREAM, *where], listen=listen, readiness={"path": "/health"},
                                   hooks={"beforeCheckpoint": [{"path": "/sleep"}],
                                          "afterRestore": [{"path": "/wake_up"}]},
                                   canary={"path": "/v1/generate", "body": json.dumps({"prompt": "canary"})}),
                              workdir, engine)
    fleet = server.Fleet([s])
    try:
        status, hot = _run(fleet, lambda session, url: _stream(session, url, "stream"))
        assert status == 200 and s.tier is api.Tier.HOT
        s.freeze()
        assert s.tier is api.Tier.FROZEN and s.pid is None and s.image is not None
        status, woken = _run(fleet, lambda session, url: _stream(session, url, "stream"))
        assert status == 200 and s.tier is api.Tier.HOT
        # The wake was a restore (not a cold start), the afterRestore hook woke it (asleep it answers 503), and the
        # answer streamed: events arrived in more than one chunk, and are the same events.
        assert s.transitions[-1].source is api.Tier.FROZEN and not s.transitions[-1].fallback
        assert len(woken) > 1
        assert b"".join(woken) == b"".join(hot)
        assert b"".join(woken).count(b"data: ") == 7
    finally:
        fleet.close()


def test_kserve_model_server_frozen_and_woken_by_a_request(engine: criu.CriuEngine, workdir: pathlib.Path) -> None:
    s = server.ServerInstance(spec("scorer", KSERVE, protocol="oip-http", readiness={"path": "/v2/health/ready"},
                                   env={"UV_USE_IO_URING": "0"},
                                   canary={"path": "/v1/models/scorer:predict", "body": json.dumps(ROWS)}),
                              workdir, engine)
    fleet = server.Fleet([s])

    async def ask(session: aiohttp.ClientSession, url: str) -> tuple[Any, int]:
        async with session.post(f"{url}/v1/models/scorer:predict", json=ROWS, headers={"x-model-id": "scorer"}) as r:
            assert r.status == 200, await r.text()
            v1 = await r.json()
        async with session.get(f"{url}/v2/models/scorer/ready") as r:  # OIP: the model from the URL
            return v1, r.status

    try:
        hot = _run(fleet, ask)
        assert hot[1] == 200 and len(hot[0]["predictions"]) == 3
        s.freeze()
        assert s.tier is api.Tier.FROZEN
        woken = _run(fleet, ask)
        assert s.transitions[-1].source is api.Tier.FROZEN and not s.transitions[-1].fallback
        assert woken == hot
    finally:
        fleet.close()


def test_handshake_image_taken_once_before_sockets(workdir: pathlib.Path) -> None:
    """The handshake's image holds no socket: the CRIU 4.1 that cannot dump TCP sockets takes it."""
    try:
        binary = criu.find_criu()
    except criu.CriuError as exc:
        pytest.skip(str(exc))
    folder = pathlib.Path(tempfile.mkdtemp(prefix="volga-hs-", dir="/dev/shm"))
    s = server.ServerInstance(spec("hs", ["-m", "tests.servers.handshake_server"], readiness={"path": "/health"},
                                   hooks={"signalFiles": True}, canary={"method": "GET", "path": "/answer"}),
                              workdir, criu.CriuEngine(folder, criu=binary))
    try:
        s.start()
        answer = s.call("GET", "/answer")
        assert s.call("GET", "/served").body == b"3"  # the probe, the canary's first ask is later: 2 + this one
        image = s.image
        assert image is not None and s.handshake_image
        for _ in range(2):
            s.freeze()
            s.wake()
            assert s.image is image and not s.transitions[-1].fallback
            assert s.call("GET", "/answer") == answer
            # Every wake starts from the image taken at the handshake: what the server served before is not in it.
            assert s.call("GET", "/served").body == b"4"
    finally:
        s.close()
        shutil.rmtree(folder, ignore_errors=True)


def test_tcp_sockets_refused_by_name_with_criu_41(workdir: pathlib.Path) -> None:
    """CRIU 4.1 cannot dump a server on a TCP port on kernels >= 6.16: the freeze is refused with the ways out, the
    beforeCheckpoint hook is undone, and the server goes on serving. Needs a CRIU 4.1.1 in $VOLGA_CRIU_41
    (`scripts/install-criu.sh PREFIX trixie`), since `make criu` installs 4.2."""
    binary = os.environ.get("VOLGA_CRIU_41", "")
    if not binary:
        pytest.skip("VOLGA_CRIU_41 names no CRIU 4.1.1 (scripts/install-criu.sh PREFIX trixie installs one)")
    old = criu.CriuEngine(tempfile.mkdtemp(prefix="volga-41-", dir="/dev/shm"), criu=binary)
    if not old.version().endswith("4.1.1") or int(os.uname().release.split(".")[0]) * 100 + int(
            os.uname().release.split(".")[1]) < 616:
        pytest.skip(f"CRIU {old.version()} on kernel {os.uname().release}: the refusal needs 4.1.1 on >= 6.16")
    s = server.ServerInstance(spec("stream41", [*STREAM, "--port", "{port}"], readiness={"path": "/health"},
                                   hooks={"beforeCheckpoint": [{"path": "/sleep"}],
                                          "afterRestore": [{"path": "/wake_up"}]}), workdir, old)
    try:
        s.start()
        with pytest.raises(server.FreezeRefused, match=r"TCP or UDP sockets.*listen: unix"):
            s.freeze()
        assert s.tier is api.Tier.HOT
        assert s.call("POST", "/v1/generate", json.dumps({"prompt": "x"}).encode()).status == 200  # awake again
    finally:
        s.close()
        shutil.rmtree(old.root, ignore_errors=True)


def test_inotify_refused_by_name(engine: criu.CriuEngine, workdir: pathlib.Path) -> None:
    s = server.ServerInstance(spec("watching", ["tests/servers/watching_server.py"]), workdir, engine)
    try:
        s.start()
        with pytest.raises(server.FreezeRefused, match="inotify"):
            s.freeze()
        assert s.tier is api.Tier.HOT and s.call("GET", "/").status == 200
    finally:
        s.close()


@pytest.mark.parametrize("compare", [["tokens", "tokens.0"], ["tokens.9"]], ids=["fields", "a-field-missing"])
def test_a_canary_compares_the_fields_it_names(engine: criu.CriuEngine, workdir: pathlib.Path,
                                               compare: list[str]) -> None:
    """`canary.compare`: the named JSON fields of the canary's answer against those it gave before the freeze; a
    field the answer lacks (the canary asks for six tokens) fails the wake, which falls back to a cold start that
    says which field."""
    body = json.dumps({"prompt": "compared", "tokens": 6})
    s = server.ServerInstance(spec("compared", [*STREAM, "--port", "{port}"], readiness={"path": "/health"},
                                   canary={"path": "/v1/generate", "body": body, "compare": compare}), workdir, engine)
    try:
        s.start()
        s.freeze()
        with s.serving():
            assert s.call("POST", "/v1/generate", body.encode()).status == 200
        wake = s.transitions[-1]
        if compare == ["tokens.9"]:
            assert wake.fallback and s.restore_failures == 1
            assert "the canary's answer: no field tokens.9 (at '9')" in wake.detail, wake.detail
        else:
            assert (wake.source, wake.fallback) == (api.Tier.FROZEN, False), wake.detail
    finally:
        s.close()


@pytest.mark.parametrize(("hold_mib", "lazily"), [(96, True), (0, False)])
def test_a_server_with_a_large_image_is_restored_lazily(engine: criu.CriuEngine, workdir: pathlib.Path,
                                                        hold_mib: int, lazily: bool) -> None:
    """Without CUDA processes, a server whose image is LAZY_MIN_BYTES or more wakes with CRIU lazy pages (the pages
    its last wake touched first, the rest after the wake), a smaller one eagerly; both answer as before."""
    body = json.dumps({"prompt": "lazy", "tokens": 5}).encode()
    s = server.ServerInstance(spec("held", ["tests/servers/aiohttp_stream_server.py", "--port", "{port}",
                                            "--hold-mib", str(hold_mib)], readiness={"path": "/health"}),
                              workdir, engine)
    try:
        s.start()
        hot = s.call("POST", "/v1/generate", body)
        for _ in range(2):  # the second wake with the first one's record
            s.freeze()
            assert s.image is not None and (s.image.size_bytes >= server.LAZY_MIN_BYTES) is lazily
            with s.serving():
                assert s.call("POST", "/v1/generate", body) == hot
            assert (s.transitions[-1].source, s.transitions[-1].fallback) == (api.Tier.FROZEN, False)
            assert s.restored_lazily is lazily
    finally:
        s.close()


def test_volga_bench_server_prints_its_keys() -> None:
    """`volga bench server --json` as users run it: KServe's cold start beside its FROZEN wake, the keys the report
    promises (no timing is asserted); its 93 MB image wakes lazily by default."""
    out = subprocess.run([sys.executable, "-m", "volga_agent.cli", "bench", "server", "-n", "1", "--servers", "kserve",
                          "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    [result] = json.loads(out.stdout)["results"]
    assert result["server"] == "kserve" and result["identical"] is True and result["restore_fallbacks"] == 0
    assert result["cold_start_ms"] > 0 and result["frozen_wake_ms"] > 0
    assert result["image_bytes"] >= server.LAZY_MIN_BYTES and result["frozen_wakes_restored_lazily"] == 1


def test_a_server_with_worker_processes_is_frozen_and_woken_whole(engine: criu.CriuEngine,
                                                                  workdir: pathlib.Path) -> None:
    """uvicorn with two worker processes (and multiprocessing's resource tracker), all under the namespace's init:
    CRIU dumps the whole tree and restores every process with its PID in the namespace; the woken workers answer as
    before."""
    s = server.ServerInstance(spec("workers", [*STREAM, "--workers", "2", "--port", "{port}"],
                                   readiness={"path": "/health"}), workdir, engine)

    def members() -> list[tuple[int, str]]:
        assert s.pid is not None
        return sorted((server.ns_pid(pid), pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().decode())
                      for pid in process.tree(s.pid))

    def answers() -> list[bytes]:
        return [s.call("POST", "/v1/generate", json.dumps({"prompt": f"worker {i}"}).encode()).body
                for i in range(8)]

    try:
        s.start()
        wait_for("both workers started", lambda: sum("multiprocessing.spawn" in c for _, c in members()) == 2)
        before, hot = members(), answers()
        assert len(before) == 5, before  # tini, uvicorn, the resource tracker, two workers
        s.freeze()
        assert s.tier is api.Tier.FROZEN and s.pid is None
        with s.serving():
            woken = answers()
        assert (s.transitions[-1].source, s.transitions[-1].fallback) == (api.Tier.FROZEN, False)
        assert woken == hot
        # Restored lazily (its image is over LAZY_MIN_BYTES), a process's command line reads empty until its pages
        # are in: the same processes, with the same PIDs, once they are.
        wait_for("the same tree", lambda: members() == before, timeout=30)
    finally:
        s.close()


@pytest.fixture
def read_only_folder(tmp_path: pathlib.Path) -> Iterator[pathlib.Path]:
    """The aiohttp server's file in a folder mounted read-only (as a node's model roots are in the agent's pod)."""
    source, view = tmp_path / "source", tmp_path / "view"
    source.mkdir()
    view.mkdir()
    shutil.copyfile(ROOT / "tests" / "servers" / "aiohttp_stream_server.py", source / "server.py")
    try:
        subprocess.run(["mount", "--bind", str(source), str(view)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"a read-only bind mount needs root: {exc}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], check=True, capture_output=True)
        yield view
    finally:
        subprocess.run(["umount", str(view)], check=True)


def test_a_server_in_a_read_only_folder_frozen_and_woken(engine: criu.CriuEngine, workdir: pathlib.Path,
                                                         read_only_folder: pathlib.Path) -> None:
    """A server runs in its own folder, which may be read-only. criu's dump of the server's PID namespace mounts a
    /proc for it on a folder it makes in the namespace init's working folder: tini is that init, working in the
    instance's folder, and the server its child, working in its own."""
    with pytest.raises(OSError, match="Read-only file system"):
        (read_only_folder / "written").write_text("")
    body = json.dumps({"prompt": "read-only", "tokens": 5})
    s = server.ServerInstance(api.ModelSpecSpec.model_validate({
        "modelId": "ro", "framework": "server", "source": str(read_only_folder),
        "server": {"command": [sys.executable, "server.py", "--unix", "{socket}"], "listen": "unix",
                   "readiness": {"path": "/health"}, "canary": {"path": "/v1/generate", "body": body}}}),
        workdir, engine)
    try:
        s.start()
        assert s.pid is not None
        init, command = process.tree(s.pid)
        assert os.readlink(f"/proc/{init}/cwd") == str(workdir)
        assert os.readlink(f"/proc/{command}/cwd") == str(read_only_folder)
        assert server.ns_pid(init) == 1 and s.stoppable() == -command
        hot = s.call("POST", "/v1/generate", body.encode())
        s.freeze()
        assert s.tier is api.Tier.FROZEN and s.pid is None
        with s.serving():
            woken = s.call("POST", "/v1/generate", body.encode())
        assert (s.transitions[-1].source, s.transitions[-1].fallback) == (api.Tier.FROZEN, False)
        assert woken == hot and hot.status == 200
    finally:
        s.close()


class _Peer(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        while self.rfile.readline():
            self.wfile.write(b"pong\n")


@pytest.fixture
def peer() -> Iterator[socketserver.ThreadingTCPServer]:
    """The service a server keeps a TCP connection open to (a database, say): it answers each line with pong."""
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Peer) as service:
        service.daemon_threads = True
        threading.Thread(target=service.serve_forever, daemon=True).start()
        yield service
        service.shutdown()


@pytest.mark.parametrize("way", ["refuse", "close", "hooks"])
def test_a_server_holding_a_connection_open(engine: criu.CriuEngine, workdir: pathlib.Path,
                                            peer: socketserver.ThreadingTCPServer, way: str) -> None:
    """CRIU restores no open TCP connection as it was. `connections: refuse` (the default): the freeze is refused,
    naming the connection, and the server goes on serving with it; `close`: frozen with it, and the woken server
    finds it closed and connects again; hooks that close it before the checkpoint and open it after the restore:
    frozen under the default, nothing lost."""
    port = peer.server_address[1]
    fields: dict[str, Any] = {"env": {"PEER_PORT": str(port)}, "readiness": {"path": "/health"}}
    if way == "close":
        fields["connections"] = "close"
    if way == "hooks":
        fields["hooks"] = {"beforeCheckpoint": [{"path": "/disconnect"}], "afterRestore": [{"path": "/connect"}]}
    s = server.ServerInstance(spec("connected", ["tests/servers/connected_server.py"], **fields), workdir, engine)
    try:
        s.start()
        assert json.loads(s.call("GET", "/ask").body) == {"peer": "pong", "reconnects": 0}
        if way == "refuse":
            with pytest.raises(server.HoldsConnections, match=rf"-> 127\.0\.0\.1:{port} \(ESTABLISHED\)"):
                s.freeze()
            assert s.tier is api.Tier.HOT
            assert json.loads(s.call("GET", "/ask").body) == {"peer": "pong", "reconnects": 0}
            return
        s.freeze()
        assert s.tier is api.Tier.FROZEN
        with s.serving():
            woken = json.loads(s.call("GET", "/ask").body)
        assert (s.transitions[-1].source, s.transitions[-1].fallback) == (api.Tier.FROZEN, False)
        assert woken == {"peer": "pong", "reconnects": 1 if way == "close" else 0}
    finally:
        s.close()


def test_idle_demotion_waits_for_requests_in_flight(engine: criu.CriuEngine, workdir: pathlib.Path) -> None:
    s = server.ServerInstance(spec("idle", [*STREAM, "--port", "{port}"], readiness={"path": "/health"}), workdir,
                              engine)
    try:
        s.start()
        assert not s.demote_if_idle(3600.0) and s.tier is api.Tier.HOT  # used just now
        s.acquire()  # a request in flight
        assert not s.demote_if_idle(0.0) and s.tier is api.Tier.HOT
        s.release()
        assert s.demote_if_idle(0.0) and s.tier is api.Tier.FROZEN
        with s.serving():  # a request wakes it
            assert s.tier is api.Tier.HOT and s.call("GET", "/health").status == 200
    finally:
        s.close()


def test_unknown_model_and_body_bound(engine: criu.CriuEngine, workdir: pathlib.Path) -> None:
    cold = server.ServerInstance(spec("cold", ["tests/servers/watching_server.py"]), workdir, engine)
    fleet = server.Fleet([cold])

    async def ask(session: aiohttp.ClientSession, url: str) -> tuple[int, int, int]:
        async with session.post(f"{url}/v1/x", headers={"x-model-id": "nope"}) as a:
            pass
        async with session.post(f"{url}/v1/x", data=b"x" * (2 << 20), headers={"x-model-id": "cold"}) as b:
            pass
        async with session.post(f"{url}/v2/models/a/infer", headers={"x-model-id": "b"}) as c:
            pass
        return a.status, b.status, c.status

    # Unknown: 404; a body over the gateway's limit: 413 before any wake; header and URL disagree: 400.
    assert _run(fleet, ask) == (404, 413, 400)
    assert cold.tier is api.Tier.COLD and cold.pid is None


def test_volga_up_serves_a_frozen_server_through_its_gateway(engine: criu.CriuEngine) -> None:
    """`volga up` with a server ModelSpec: frozen at start-up (its pool floor), its requests refused unwoken while the
    autonomy loop's actuator sheds it, woken by the first request to the gateway's HTTP port once unshed, the answer
    streamed; the OIP routes still answer for other models."""
    from volga_bench import harness

    doc = {"apiVersion": api.API_VERSION, "kind": "ModelSpec", "metadata": {"name": "stream"},
           "spec": spec("stream", [*STREAM, "--port", "{port}"], readiness={"path": "/health"},
                        canary={"path": "/v1/generate", "body": json.dumps({"prompt": "canary"})}).to_wire()}
    bg, up = harness.start_embedded([api.parse_model_spec(doc)])
    try:
        bg.call(up.wait_converged(), timeout=120)
        s = up.pool.servers.slots["stream-0"].inst  # the pool's server instance, as a cluster node's agent runs it
        assert s.tier is api.Tier.FROZEN

        # Shed by the autonomy loop's actuator: refused by the gateway before any wake, with the retry hint.
        actuator = loop.PoolActuator(up.pool, up.gateway.dataplane)
        try:
            loop.apply(decider.Shed("stream", 1500), actuator)

            async def refused() -> tuple[int, str, dict[str, Any]]:
                async with aiohttp.ClientSession() as session, \
                        session.post(f"{up.endpoints()['http']}/v1/stream", json={"prompt": "volga"},
                                     headers={"x-model-id": "stream"}) as r:
                    return r.status, r.headers.get("Retry-After", ""), await r.json()

            status, retry_after, body = asyncio.run(refused())
            assert (status, retry_after) == (429, "2") and "shedding load" in body["error"]
            assert s.tier is api.Tier.FROZEN and s.transitions[-1].target is api.Tier.FROZEN  # not woken
            shed = up.gateway.dataplane.drain_load()["stream"]
            assert (shed.arrivals, shed.completed, shed.queue_depth, shed.shed) == (1, 0, 0, 1)
            loop.apply(decider.Unshed("stream"), actuator)
        finally:
            actuator.close()

        async def ask() -> tuple[int, list[bytes], int]:
            async with aiohttp.ClientSession() as session:
                status, chunks = await _stream(session, up.endpoints()["http"], "stream")
                async with session.get(f"{up.endpoints()['http']}/v2/models/other/ready") as r:
                    return status, chunks, r.status

        status, chunks, other = asyncio.run(ask())
        assert status == 200 and len(chunks) > 1 and b"".join(chunks).count(b"data: ") == 7
        assert s.tier is api.Tier.HOT and s.transitions[-1].source is api.Tier.FROZEN
        assert not s.transitions[-1].fallback
        assert other == 400  # not a server: the OIP handler answers (a model it does not have is not ready)
        # The request counts in the load the node's autonomy loop reads, as a built-in model's: from its wake to the
        # last event streamed.
        load = up.gateway.dataplane.drain_load()["stream"]
        assert (load.arrivals, load.completed, load.queue_depth, len(load.latencies_ms)) == (1, 1, 0, 1)
        assert load.latencies_ms[0] >= 5 * 30  # six events 30 ms apart, after the wake
        with urllib.request.urlopen(up.endpoints()["metrics"]) as r:
            scraped = r.read().decode()
        assert 'volga_tier_transition_latency_ms_count{model="stream",source="FROZEN",target="HOT"} 1.0' in scraped
    finally:
        bg.call(up.stop(), timeout=60)
        bg.close()


def _counted(metrics_url: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples with these labels in one process's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))


def test_volga_up_server_reached_by_every_gateway_process(engine: criu.CriuEngine, tmp_path: pathlib.Path) -> None:
    """`volga up --gateway-processes 2` with a server ModelSpec: the pool runs it as a cluster node's agent does
    (FROZEN at start-up), `volga status --agent` lists it with its tier; requests on fresh connections, spread by the
    kernel over both gateway processes (the second leases the server through the Agent API), are all answered, the
    same, by one wake from FROZEN; idle again, it goes back to FROZEN."""

    import yaml
    from procs import wait_for

    from volga_bench import harness

    doc = {"apiVersion": api.API_VERSION, "kind": "ModelSpec", "metadata": {"name": "stream"},
           "spec": spec("stream", [*STREAM, "--port", "{port}"], readiness={"path": "/health"},
                        canary={"path": "/v1/generate", "body": json.dumps({"prompt": "canary"})}).to_wire()}
    (tmp_path / "stream.yaml").write_text(yaml.safe_dump(doc))

    def listed(up: harness.UpProcess) -> list[str]:
        return tiers(up.endpoints["agent"], "stream")

    async def spread(url: str, count: int) -> list[tuple[int, list[bytes]]]:
        async def one() -> tuple[int, list[bytes]]:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
                return await _stream(session, url, "stream")  # a connection of its own
        return list(await asyncio.gather(*(one() for _ in range(count))))

    # The server's folder is this checkout: the model roots name it (a server's files lie inside them).
    with harness.volga_up(["-f", str(tmp_path / "stream.yaml"), "--model-root", str(ROOT), "--gateway-processes", "2",
                           "--idle-sec", "2"]) as up:
        metrics = [up.endpoints["metrics"], up.endpoints["metrics1"]]
        wait_for("the server frozen at its floor", lambda: listed(up) == ["FROZEN"], timeout=120, every=0.5)
        answers = asyncio.run(spread(up.endpoints["http"], 24))  # all on one process by chance: 2 in 2**24
        assert all(status == 200 for status, _ in answers)
        bodies = {b"".join(chunks) for _, chunks in answers}
        assert len(bodies) == 1 and next(iter(bodies)).count(b"data: ") == 7

        def served() -> list[float]:
            return [_counted(url, "volga_gateway_requests_total", model="stream", protocol="http", code="OK")
                    for url in metrics]

        # A process counts an answer once its last byte is sent: the client may have read it a moment before.
        wait_for("every answer counted", lambda: sum(served()) == 24, timeout=30, every=0.1)
        assert min(served()) > 0, served()
        # One wake from FROZEN for all of them, whichever process they came through.
        assert _counted(metrics[0], "volga_activations_total", tier="FROZEN", model="stream") == 1
        assert _counted(metrics[0], "volga_snapshot_restore_failures_total", model="stream") == 0
        assert listed(up) == ["HOT"]
        wait_for("the idle server frozen again", lambda: listed(up) == ["FROZEN"], timeout=60, every=0.5)


class _NoCuda:
    """The driver's checkpoint API for a server whose tree holds no CUDA context: the GPU ladder's WARM step is the
    hooks alone, and nothing may be handed to the driver (any call fails the test)."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"driver.{name} called for a server without a CUDA context")


def test_gpu_ladder_warm_is_the_hooks_tier(engine: criu.CriuEngine, workdir: pathlib.Path) -> None:
    """On a GPU node: HOT -> WARM runs the beforeCheckpoint hooks (the server sleeps: 503), a wake in place runs
    afterRestore and the canary; SUSPENDED is refused, naming why, for a tree without a CUDA context; FROZEN from
    WARM keeps the server asleep in its image and the wake after the restore wakes it; idle demotion walks the
    ladder without SUSPENDED."""
    body = json.dumps({"prompt": "ladder", "tokens": 6}).encode()
    hooks = {"beforeCheckpoint": [{"method": "POST", "path": "/sleep"}],
             "afterRestore": [{"method": "POST", "path": "/wake_up"}]}
    s = server.ServerInstance(spec("sleepy", [*STREAM, "--port", "{port}"], readiness={"path": "/health"},
                                   hooks=hooks, canary={"path": "/v1/generate", "body": body.decode()}),
                              workdir, engine, driver=_NoCuda())  # type: ignore[arg-type]
    try:
        s.start()
        awake = s.call("POST", "/v1/generate", body)
        assert awake.status == 200
        s.warm()
        assert s.tier is api.Tier.WARM and s.slept and s.call("POST", "/v1/generate", body).status == 503
        with pytest.raises(server.ServerError, match="no process of the server holds a CUDA context"):
            s.suspend()
        assert s.tier is api.Tier.WARM
        with s.serving():
            assert s.call("POST", "/v1/generate", body) == awake
        assert s.transitions[-1].source is api.Tier.WARM and not s.transitions[-1].fallback
        s.warm()
        s.freeze()
        assert s.tier is api.Tier.FROZEN and s.pid is None and s.slept
        with s.serving():
            assert s.call("POST", "/v1/generate", body) == awake and not s.slept
        wake = s.transitions[-1]
        assert (wake.source, wake.fallback) == (api.Tier.FROZEN, False)
        # its phases: criu's restore, the agent's steps on the restored tree, the server's own wake (the hooks), the
        # lazy pages let go; within the move
        assert {"restore", "adopt", "wake", "release"} <= set(wake.phases) and sum(wake.phases.values()) < wake.seconds
        assert s.demote_if_idle(0.0, gpu_idle=(0.0, 0.0)) and s.tier is api.Tier.WARM
        assert not s.demote_if_idle(0.0, gpu_idle=(0.0, 0.0), floor=api.Tier.WARM) and s.tier is api.Tier.WARM
        assert s.demote_if_idle(0.0, gpu_idle=(0.0, 0.0)) and s.tier is api.Tier.FROZEN  # SUSPENDED passed over
    finally:
        s.close()


class _StandInDriver:
    """The CUDA driver's checkpoint API as the stand-in server (`tests/servers/device_copy_server.py`) plays it: its
    copy of the device memory made in host memory at the checkpoint, checked against what it was and given back at
    the restore (a copy that differs fails the restore)."""

    def __init__(self) -> None:
        self.server: server.ServerInstance | None = None
        self.premapped: list[int] = []  # at each restore: the parked bytes faulted in for it (`Parking.premap`)

    def _ask(self, pid: int, path: str) -> None:
        assert self.server is not None
        answer = self.server.call("POST", path)
        if answer.status != 200:
            raise cuda.DriverCheckpointError(path, pid, answer.status, answer.body.decode())

    def suspend(self, pid: int) -> None:
        self._ask(pid, "/checkpoint")

    def resume(self, pid: int) -> float:
        assert self.server is not None
        premapped = self.server.parking.premapped
        assert all(started.wait(30) for started in premapped)
        self.premapped.append(sum(started.read for started in premapped))
        self._ask(pid, "/restore")
        return 0.0


def _stand_ins(root: int) -> list[int]:
    """The processes of a tree that play their own driver (`tests/servers/device_copy_server.py`), taken for those
    holding a CUDA context."""
    return [pid for pid in process.tree(root)
            if b"device_copy_server" in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()]


@pytest.mark.parametrize(("parks", "huge"), [(True, False), (True, True), (False, False)],
                         ids=["through-the-handshake-module", "on-huge-pages", "as-it-is"])
def test_a_gpu_servers_driver_copy_parked_beside_its_image(engine: criu.CriuEngine, workdir: pathlib.Path,
                                                            monkeypatch: pytest.MonkeyPatch, parks: bool,
                                                            huge: bool) -> None:
    """A server run through `python -m volga_agent.worker.handshake` parks the driver's copy: at each freeze its
    thread moves the pages the checkpoint filled into a file beside the images and maps it over them, the image
    leaves them out, and the wake restores the tree lazily with the copy intact (the stand-in driver checks it);
    the next freeze's file replaces the last one, and closing removes it. The same with the parked folder on the
    tmpfs of huge pages the agent mounts there on a GPU node (`tmpfs.mount_huge`). Run as it is, the same server's
    copy is in its image and its restore is eager. The stand-in plays its own driver (it holds no CUDA context)."""
    if huge and huge_tmpfs_unavailable():
        pytest.skip(huge_tmpfs_unavailable())
    monkeypatch.setattr(server, "cuda_processes", _stand_ins)
    copy = device_copy_server.COPY_MIB * 2**20
    driver = _StandInDriver()
    command = [*(["-m", "volga_agent.worker.handshake"] if parks else []), "tests/servers/device_copy_server.py"]
    s = server.ServerInstance(spec("copy", command, readiness={"path": "/health"},
                                   canary={"method": "GET", "path": "/answer"}), workdir, engine,
                              driver=driver)  # type: ignore[arg-type]
    driver.server = s
    parked_root = engine.root / instance.PARKED
    mounted = huge and tmpfs.mount_huge(parked_root)
    assert mounted is huge and tmpfs.huge(parked_root) is huge
    try:
        s.start()
        for _ in range(2):
            s.freeze()
            assert s.tier is api.Tier.FROZEN and s.image is not None
            reports = list(s.driver_copies.values())
            if parks:
                assert len(reports) == 1 and "error" not in reports[0], reports
                assert int(reports[0]["bytes"]) >= copy and s.copies_parked  # type: ignore[call-overload]
                assert s.parking.current is not None and s.parking.current.stat().st_size >= copy
                assert tmpfs.huge(s.parking.current) is huge
                assert s.parking.folder is not None and list(s.parking.folder.iterdir()) == [s.parking.current]
                assert s.image.size_bytes < copy
            else:
                assert not reports and not s.copies_parked and s.image.size_bytes > copy
            # asked to lower its CUDA stack before the driver's checkpoint, it answered: no context to lower (or no
            # driver to ask, here), and the freeze went on
            trims = list(s.stack_trims.values())
            if parks:
                assert len(trims) == 1 and (trims[0].get("contexts") == 0 or "CUDA driver" in str(trims[0]["error"]))
            else:
                assert not trims
            assert not [f.name for f in s.signals.iterdir() if "cuda-stack" in f.name]
            with s.serving():
                assert s.call("GET", "/answer").body == device_copy_server.ANSWER
            wake = s.transitions[-1]
            assert (wake.source, wake.fallback) == (api.Tier.FROZEN, False), wake.detail
            assert s.restored_lazily is parks and {"restore", "driver"} <= set(wake.phases)
            # parked, the copy was in the stand-in's page tables before its driver's restore read it
            assert (driver.premapped[-1] >= copy) if parks else driver.premapped[-1] == 0, driver.premapped
    finally:
        s.close()
        if mounted:
            tmpfs.unmount(parked_root)
    assert s.parking.folder is not None and not s.parking.folder.exists()
    assert not tmpfs.huge(parked_root)


def test_a_server_sleeps_deeper_before_a_freeze(engine: criu.CriuEngine, workdir: pathlib.Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """hooks.beforeFreeze: the server sleeps through beforeCheckpoint (level 1) for WARM and SUSPENDED and through
    beforeFreeze (level 2) for a CRIU freeze. From SUSPENDED the freeze has the driver restore it, wakes it, sets it
    to sleep at level 2 and checkpoints it again before the dump; a wake from the image wakes it; a freeze from HOT
    sleeps at level 2 alone; a beforeFreeze hook that fails leaves it SUSPENDED, asleep at level 1 again. The
    stand-in plays its own driver (a copy of its "device memory" checked at each restore)."""
    monkeypatch.setattr(server, "cuda_processes", _stand_ins)
    driver = _StandInDriver()
    hooks = {"beforeCheckpoint": [{"path": "/sleep?level=1"}], "beforeFreeze": [{"path": "/sleep?level=2"}],
             "afterRestore": [{"path": "/wake_up"}]}
    s = server.ServerInstance(spec("deeper", ["tests/servers/device_copy_server.py"], readiness={"path": "/health"},
                                   hooks=hooks, canary={"method": "GET", "path": "/answer"}), workdir, engine,
                              driver=driver)  # type: ignore[arg-type]
    driver.server = s

    def events() -> list[str]:
        return s.call("GET", "/events").body.decode().split(",")

    try:
        s.start()
        s.warm()
        assert (s.tier, s.slept, events()) == (api.Tier.WARM, "beforeCheckpoint", ["sleep 1"])
        s.suspend()
        assert (s.tier, s.slept, len(s.gpu_pids)) == (api.Tier.SUSPENDED, "beforeCheckpoint", 1)
        s.freeze()
        assert (s.tier, s.slept, s.pid) == (api.Tier.FROZEN, "beforeFreeze", None)
        with s.serving():
            assert s.call("GET", "/answer").body == device_copy_server.ANSWER
            assert events() == ["sleep 1", "wake", "sleep 2", "wake"]
        assert (s.transitions[-1].source, s.transitions[-1].fallback) == (api.Tier.FROZEN, False)
        s.freeze()
        with s.serving():
            assert events() == ["sleep 1", "wake", "sleep 2", "wake", "sleep 2", "wake"]
        # beforeFreeze refused (the server is asleep already when it is called): the freeze fails and the server is
        # SUSPENDED as it was, asleep at level 1 under the driver's checkpoint
        s.suspend()
        bad = s.server.model_copy(update={"hooks": api.Hooks.model_validate(
            {**hooks, "beforeFreeze": [{"path": "/sleep?level=2"}, {"path": "/sleep?level=3"}]})})
        monkeypatch.setattr(s, "server", bad)
        with pytest.raises(server.ServerError, match=r"hooks.beforeFreeze POST /sleep\?level=3 answered 409"):
            s.freeze()
        assert (s.tier, s.slept, len(s.gpu_pids)) == (api.Tier.SUSPENDED, "beforeCheckpoint", 1)
        with s.serving():
            assert s.call("GET", "/answer").body == device_copy_server.ANSWER
            assert events()[-6:] == ["sleep 1", "wake", "sleep 2", "wake", "sleep 1", "wake"]
        assert not any(t.fallback for t in s.transitions)
    finally:
        s.close()


def test_a_suspended_server_is_restored_before_its_freeze_hooks(engine: criu.CriuEngine, workdir: pathlib.Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A server with beforeFreeze alone is not set to sleep for SUSPENDED; freezing it then calls beforeFreeze, so
    the driver restores it first (the stand-in refuses to sleep while checkpointed) and checkpoints it again."""
    monkeypatch.setattr(server, "cuda_processes", _stand_ins)
    driver = _StandInDriver()
    hooks = {"beforeFreeze": [{"path": "/sleep?level=2"}], "afterRestore": [{"path": "/wake_up"}]}
    s = server.ServerInstance(spec("frozen-only", ["tests/servers/device_copy_server.py"],
                                   readiness={"path": "/health"}, hooks=hooks,
                                   canary={"method": "GET", "path": "/answer"}), workdir, engine,
                              driver=driver)  # type: ignore[arg-type]
    driver.server = s
    try:
        s.start()
        s.suspend()
        assert (s.tier, s.slept, len(s.gpu_pids)) == (api.Tier.SUSPENDED, "", 1)
        s.freeze()
        assert (s.tier, s.slept) == (api.Tier.FROZEN, "beforeFreeze")
        with s.serving():
            assert s.call("GET", "/events").body == b"sleep 2,wake"
        assert not any(t.fallback for t in s.transitions)
    finally:
        s.close()


def test_a_floor_the_ladder_lacks_rests_below_it(engine: criu.CriuEngine, workdir: pathlib.Path) -> None:
    """A SUSPENDED floor for a server without a CUDA context (a CPU server on a GPU node) rests FROZEN, the next tier
    its ladder has, both when it is brought to its floor and when idle demotion takes it there."""
    s = server.ServerInstance(spec("floor", [*STREAM, "--port", "{port}"], readiness={"path": "/health"}), workdir,
                              engine, driver=_NoCuda())  # type: ignore[arg-type]
    try:
        s.start()
        s.settle(api.Tier.SUSPENDED)
        assert s.tier is api.Tier.FROZEN
        with s.serving():
            assert s.call("GET", "/health").status == 200
        assert s.demote_if_idle(0.0, gpu_idle=(0.0, 0.0), floor=api.Tier.SUSPENDED) and s.tier is api.Tier.FROZEN
    finally:
        s.close()


OIP_STREAM = ["-m", "volga_bench.servers.oip_stream_app", "--http-port", "{port}", "--grpc-port", "{grpc_port}"]


@contextlib.contextmanager
def _grpc_gateway(fleet: server.Fleet) -> Iterator[app.Gateway]:
    """The gateway's gRPC port (and HTTP) in front of `fleet`, on a loop of its own: tritonclient calls it from this
    thread."""
    from volga_agent import errors
    from volga_bench import harness

    def no_workers(model_id: str, device_hint: str) -> links.Route:
        raise errors.UnknownModel(f"{model_id}: only model servers here")

    async def make() -> app.Gateway:
        specs = {model_id: i.spec for model_id, i in fleet.instances.items()}
        gw = app.Gateway(catalog.Catalog(specs), links.LocalAgentLink(no_workers),
                         app.Settings(http_port=0, grpc_port=0, metrics_port=0), servers=fleet)
        await gw.start()
        return gw

    bg = harness.Background()
    try:
        gw = bg.call(make())
        try:
            yield gw
        finally:
            bg.call(gw.stop())
    finally:
        bg.close()


def _decoupled(address: str, requests: list[tuple[str, str, int]], between: Any = None,
               headers: dict[str, str] | None = None) -> list[tuple[Any, ...]]:
    """What an unmodified tritonclient's stream callback got for `requests` (id, model, N responses asked for; 0:
    the request asks the server to end the stream), each sent once the answers of the one before are in (so their
    order is the requests'): (id, y, step, final) for an answer, ("error", message) for an error. `between()` runs
    after the first request's answers, the stream open."""
    import tritonclient.grpc as grpcclient

    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    answers: list[tuple[Any, ...]] = []
    client = grpcclient.InferenceServerClient(address)
    try:
        client.start_stream(lambda result, error: got.put((result, error)), stream_timeout=240, headers=headers)
        for n, (request_id, model, count) in enumerate(requests):
            x = np.linspace(-2.0, 2.0, 12, dtype=np.float32).reshape(3, 4) * (n + 1)
            item = grpcclient.InferInput("x", list(x.shape), "FP32")
            item.set_data_from_numpy(x)
            parameters: dict[str, Any] = {"responses": count} if count else {"end_stream": True}
            client.async_stream_infer(model, [item], request_id=request_id, parameters=parameters)
            for _ in range(max(count, 1)):
                result, error = got.get(timeout=240)  # a bound on a hang, not a measurement
                if error is not None:
                    answers.append(("error", str(error)))
                    break
                response = result.get_response()
                answers.append((response.id, result.as_numpy("y"), int(result.as_numpy("step")[0]),
                                response.parameters["triton_final_response"].bool_param))
            if n == 0 and between is not None:
                between()
        client.stop_stream()
    finally:
        client.close()
    assert got.empty()
    return answers


def test_oip_grpc_stream_frozen_server_woken_by_tritonclient_stream(engine: criu.CriuEngine,
                                                                    workdir: pathlib.Path) -> None:
    """A decoupled OIP gRPC server (several answers per request) behind the gateway's ModelStreamInfer: HOT, then
    FROZEN by CRIU and woken by a tritonclient stream, every answer the same and in order; held HOT while its stream
    is open and given back when its client goes away; a request for another model answered with an error while the
    stream goes on; a stream bound by
    x-model-id, and one the server ends with its status; a stream for an HTTP-only server refused request by
    request, without waking it."""
    import tritonclient.grpc as grpcclient

    counter = server.ServerInstance(spec("counter", OIP_STREAM, protocol="oip-grpc",
                                         readiness={"path": "/v2/health/ready"}), workdir, engine)
    plain = server.ServerInstance(spec("plain", [*STREAM, "--port", "{port}"], readiness={"path": "/health"}),
                                  workdir, engine)
    fleet = server.Fleet([counter, plain])
    requests = [("a", "counter", 3), ("b", "counter", 1), ("bad", "other", 1), ("c", "counter", 4)]
    held: list[list[str]] = []
    try:
        with _grpc_gateway(fleet) as gw:
            address = f"127.0.0.1:{gw.ports['grpc']}"
            hot = _decoupled(address, requests, between=lambda: held.append(fleet.demote_idle(0.0)))
            assert held == [[]] and counter.tier is api.Tier.HOT  # its stream was open: not frozen
            assert fleet.demote_idle(0.0) == ["counter"]  # closed: idle
            assert counter.tier is api.Tier.FROZEN and counter.pid is None and counter.image is not None
            woken = _decoupled(address, requests)
            assert counter.tier is api.Tier.HOT
            assert counter.transitions[-1].source is api.Tier.FROZEN and not counter.transitions[-1].fallback

            x = np.linspace(-2.0, 2.0, 12, dtype=np.float32).reshape(3, 4) * 2
            item = grpcclient.InferInput("x", list(x.shape), "FP32")
            item.set_data_from_numpy(x)
            client = grpcclient.InferenceServerClient(address)
            try:
                unary = client.infer("counter", [item]).as_numpy("y")
                # A client that goes away with its stream open gives the server back: idle, it freezes again.
                got: queue.Queue[tuple[Any, Any]] = queue.Queue()
                client.start_stream(lambda result, error: got.put((result, error)))
                client.async_stream_infer("counter", [item], request_id="z", parameters={"responses": 2})
                assert [got.get(timeout=240)[1] for _ in range(2)] == [None, None]
                held.append(fleet.demote_idle(0.0))
                client.stop_stream(cancel_requests=True)
            finally:
                client.close()
            assert held == [[], []]  # the open stream held it
            wait_for("the server of the cancelled stream to freeze", lambda: fleet.demote_idle(0.0) == ["counter"])
            assert counter.tier is api.Tier.FROZEN
            # Bound by x-model-id (and woken again): a request naming no model is for it; the server's status ends
            # the stream.
            named = _decoupled(address, [("d", "", 2), ("e", "counter", 0)], headers={"x-model-id": "counter"})
            refused = _decoupled(address, [("p", "plain", 1), ("q", "plain", 1)])
            counted = {(model, code): gw.metrics.registry.get_sample_value(
                "volga_gateway_requests_total", {"model": model, "protocol": "grpc-stream", "code": code})
                for model, code in (("counter", "OK"), ("counter", "ABORTED"), ("counter", "CANCELLED"),
                                    ("plain", "OK"))}
    finally:
        fleet.close()

    # a0 a1 a2, b0, the refusal of "bad", c0 .. c3: each request's answers in order, the last marked final.
    assert [a[0] for a in hot] == ["a", "a", "a", "b", "error", "c", "c", "c", "c"]
    assert [a[2:] for a in hot if a[0] != "error"] == [(0, False), (1, False), (2, True), (0, True),
                                                       (0, False), (1, False), (2, False), (3, True)]
    assert "this stream is passed through to model server 'counter'" in hot[4][1] and "'other'" in hot[4][1]
    assert len(woken) == len(hot)
    for before, after in zip(hot, woken, strict=True):
        assert before[0] == after[0]
        if before[0] != "error":
            np.testing.assert_array_equal(before[1], after[1])
            assert before[2:] == after[2:]
    np.testing.assert_array_equal(unary, hot[3][1])  # ModelInfer answers as the stream's single answer does
    assert [a[0] for a in refused] == ["error", "error"]
    assert "UNIMPLEMENTED: plain is a model server without gRPC" in refused[0][1]
    assert plain.tier is api.Tier.COLD and plain.pid is None
    assert [a[0] for a in named] == ["d", "d", "error"] and named[1][2:] == (1, True)
    assert "[StatusCode.ABORTED] request 'e' asked to end the stream" in named[2][1]
    # A stream counts once, with its status.
    assert counted == {("counter", "OK"): 2.0, ("counter", "ABORTED"): 1.0, ("counter", "CANCELLED"): 1.0,
                       ("plain", "OK"): 1.0}
