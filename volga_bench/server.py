"""`volga bench server`: a model server's cold start beside its FROZEN wake, both through the gateway's proxy.

For each server (KServe's `ModelServer` with custom pre/post-processing, a FastAPI/uvicorn app streaming its
answer; `volga_bench.servers`), in one run: `n` cold starts (a COLD instance, one request through the proxy: the
process starts, loads, passes its readiness probe and answers) and `n` wakes (the instance FROZEN by CRIU, one
request through the proxy: the restore, the hooks, the canary, the answer). Times are from the request sent to the
whole answer received; `identical` says every answer equals the first cold start's.

With `--listen-variants`, the FastAPI server is also run listening on a Unix socket the instance hands it, and, with
`--compare-criu PATH` (another CRIU, such as 4.1.1 from trixie: `scripts/install-criu.sh PREFIX trixie`), frozen by
that CRIU too: the ways around CRIU 4.1's failure to dump TCP sockets on kernels >= 6.16, side by side. A variant
that CRIU cannot dump is reported with its error. Two CRIU releases in one run share criu's kernel-probe cache
(`snapshot.kdat`) and spoil it for each other: the wakes of such a run are slower than those of a run with one.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from volga_agent.gateway import proxy
from volga_agent.node import server
from volga_agent.snapshot import criu
from volga_bench import reporting
from volga_core import api

ROWS = {"instances": [[float(i * j % 7) for i in range(16)] for j in range(1, 4)]}
PROMPT = {"prompt": "volga", "tokens": 8}


def _spec(model_id: str, command: list[str], **fields: Any) -> api.ModelSpecSpec:
    return api.ModelSpecSpec.model_validate({"modelId": model_id, "framework": "server",
                                             "source": str(pathlib.Path.cwd()),
                                             "server": {"command": [sys.executable, *command], **fields}})


STREAM = ["-m", "uvicorn", "volga_bench.servers.stream_app:app", "--no-access-log", "--loop", "asyncio"]


def variants(compare: bool) -> dict[str, tuple[api.ModelSpecSpec, str, bytes]]:
    """The FastAPI server listening on a Unix socket, and with `compare` both frozen by the other CRIU (@other)."""
    unix = (_spec("stream", [*STREAM, "--uds", "{socket}"], listen="unix", readiness={"path": "/health"},
                  canary={"path": "/v1/generate", "body": json.dumps(PROMPT)}),
            "/v1/stream", json.dumps(PROMPT).encode())
    port = servers()["fastapi-stream"]
    return {"fastapi-stream-unix": unix, **({"fastapi-stream@other": port, "fastapi-stream-unix@other": unix}
                                             if compare else {})}


def servers() -> dict[str, tuple[api.ModelSpecSpec, str, bytes]]:
    """Each server's spec, and the request (path, JSON body) the bench sends it."""
    return {
        "kserve": (_spec("scorer", ["-m", "volga_bench.servers.kserve_scorer", "--http_port", "{port}",
                                    "--enable_grpc", "false", "--model_name", "scorer", "--configure_logging", "false"],
                         protocol="oip-http", readiness={"path": "/v2/health/ready"},
                         canary={"path": "/v1/models/scorer:predict", "body": json.dumps(ROWS)}),
                   "/v1/models/scorer:predict", json.dumps(ROWS).encode()),
        "fastapi-stream": (_spec("stream", [*STREAM, "--port", "{port}"],
                                 readiness={"path": "/health"},
                                 canary={"path": "/v1/generate", "body": json.dumps(PROMPT)}),
                           "/v1/stream", json.dumps(PROMPT).encode()),
    }


async def _ask(url: str, model: str, path: str, body: bytes) -> tuple[float, bytes]:
    began = time.perf_counter()
    async with aiohttp.ClientSession() as session, session.post(
            url + path, data=body, headers={"x-model-id": model, "Content-Type": "application/json"}) as r:
        answer = await r.read()
        if r.status != 200:
            raise RuntimeError(f"{model}: {r.status} {answer[:200]!r}")
    return (time.perf_counter() - began) * 1000, answer


def _p50(values: list[float]) -> float:
    return round(statistics.median(values), 1)


async def _one(name: str, spec: api.ModelSpecSpec, path: str, body: bytes, n: int, engine: criu.CriuEngine,
               work: pathlib.Path, progress: Callable[[str], None], lazy: bool = False) -> dict[str, Any]:
    instance = server.ServerInstance(spec, work / name, engine)
    fleet = server.Fleet([instance])
    runner = web.AppRunner(proxy.app(fleet))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    cold: list[float] = []
    wakes: list[float] = []
    answers: list[bytes] = []
    lazy_wakes: list[float] = []  # with `lazy`: the same wakes restored lazily, alternating with the eager ones
    lazily = 0  # the wakes of `wakes` restored lazily
    listen = spec.server.listen.value if spec.server is not None else ""
    try:
        for i in range(n):
            await asyncio.to_thread(instance.close)
            ms, answer = await _ask(url, spec.model_id, path, body)
            cold.append(ms)
            answers.append(answer)
            progress(f"{name}: cold start {i + 1}/{n}: {ms:.0f} ms")
        for i in range(n * (2 if lazy else 1)):
            if lazy:  # eager, lazy, eager, ...
                instance.lazy_restore = i % 2 == 1
            try:
                await asyncio.to_thread(instance.freeze)
            except (criu.CriuError, server.FreezeRefused) as exc:
                progress(f"{name}: CRIU cannot freeze it: {str(exc).splitlines()[-1]}")
                return {"server": name, "listen": listen, "criu": engine.version().removeprefix("Version: "),
                        "cold_start_ms": _p50(cold), "frozen_wake_ms": None, "identical": False,
                        "dump_error": str(exc)[-600:]}
            ms, answer = await _ask(url, spec.model_id, path, body)
            made_lazy = bool(lazy and instance.lazy_restore)  # one of `lazy`'s lazy wakes
            (lazy_wakes if made_lazy else wakes).append(ms)
            if not made_lazy:
                lazily += instance.restored_lazily  # the defaults' way (`server.LAZY_MIN_BYTES`), or eager
            answers.append(answer)
            progress(f"{name}: FROZEN wake {i + 1}/{n * (2 if lazy else 1)}{' (lazy)' if made_lazy else ''}: "
                     f"{ms:.0f} ms")
        fallbacks = sum(t.fallback for t in instance.transitions)
        restores = [t.phases.get("restore", 0.0) * 1000 for t in instance.transitions if t.source is api.Tier.FROZEN]
        if lazy:  # the eager wakes' restores only, as without `lazy`
            restores = restores[::2]
        image = instance.image.size_bytes if instance.image is not None else 0
    finally:
        await asyncio.to_thread(fleet.close)
        await runner.cleanup()
    return {"server": name, "listen": listen, "criu": engine.version().removeprefix("Version: "),
            "cold_start_ms": _p50(cold), "frozen_wake_ms": _p50(wakes),
            "identical": all(a == answers[0] for a in answers) and fallbacks == 0,
            "speedup": round(_p50(cold) / _p50(wakes), 1), "cold_start_ms_all": [round(v, 1) for v in cold],
            "frozen_wake_ms_all": [round(v, 1) for v in wakes],
            "criu_restore_ms_all": [round(v, 1) for v in restores], "image_bytes": image,
            "frozen_wakes_restored_lazily": lazily,
            "restore_fallbacks": fallbacks,
            **({"frozen_lazy_wake_ms": _p50(lazy_wakes), "lazy_speedup": round(_p50(cold) / _p50(lazy_wakes), 1),
                "frozen_lazy_wake_ms_all": [round(v, 1) for v in lazy_wakes],
                "lazy_pages_server": engine.lazy_pages_server} if lazy else {})}


def bench(n: int = 5, only: list[str] | None = None, listen_variants: bool = False, compare_criu: str = "",
          progress: Callable[[str], None] = lambda _: None, lazy: bool = False) -> dict[str, Any]:
    engine_root = pathlib.Path(tempfile.mkdtemp(prefix="volga-bench-server-", dir="/dev/shm"))
    work = pathlib.Path(tempfile.mkdtemp(prefix="vbs-"))
    load_before = os.getloadavg()
    try:
        engines = {"": criu.CriuEngine(engine_root / "criu", criu=criu.find_criu())}
        runs = {name: run for name, run in servers().items() if not only or name in only}
        if listen_variants:
            runs |= variants(bool(compare_criu))
        if compare_criu:
            engines["@other"] = criu.CriuEngine(engine_root / "other", criu=compare_criu)
        results = [asyncio.run(_one(name, spec, path, body, n, engines["@other" if "@other" in name else ""],
                                    work, progress, lazy)) for name, (spec, path, body) in runs.items()]
        return {"bench": "server", "n": n, "device": reporting.device_description("cpu"),
                "kernel": platform.release(), "load_average_before": [round(x, 2) for x in load_before],
                "load_average_after": [round(x, 2) for x in os.getloadavg()],
                "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": results}
    finally:
        shutil.rmtree(engine_root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
