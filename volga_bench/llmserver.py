"""`volga bench server --gpu`: an LLM server's time to first token from a cold start, from SUSPENDED and from
FROZEN, with and without the hooks that release its memory before a checkpoint, in one run on one GPU.

The server is `volga_bench.servers.llm_app` (a 1.17B-parameter Llama-architecture model in fp16 with a KV cache
preallocated for `cache_tokens` tokens, streaming over HTTP; it knows nothing of Volga). It runs as a Volga server
instance (`node.server.ServerInstance`) with the CUDA driver's checkpoint API, behind the gateway's proxy, once per
way of sleeping:

    none      no hooks: the driver's checkpoint carries the weights and the whole KV cache into host memory, and
              CRIU's image carries them too
    level1    `POST /sleep?level=1` before, `POST /wake_up` after (vLLM's sleep mode): the KV cache released and
              the weights copied to host memory before the checkpoint, copied back at wake-up
    level2    `POST /sleep?level=2`: the KV cache and the weights released (read again from the model's file,
              in the page cache, at wake-up)
    level1-freeze2  level 1 for SUSPENDED, level 2 before a freeze (`hooks.beforeFreeze`)

A way may add `-parked`: the server runs through `python -m volga_agent.worker.handshake`, which parks the driver's
copy beside the image at each freeze (the image leaves it out), and its FROZEN wakes restore lazily; `-eager` after it
restores them eagerly. Without it, FROZEN wakes restore eagerly (`LAZY` says why). The canary is a one-token
completion: it is on every wake's path.

Each request streams `max_tokens` tokens; the time to first token is from the request sent to the first event
received, the answer every event. `identical` says every answer of the run equals the first cold start's. Image
sizes are CRIU's image folder; the SUSPENDED host memory is the tree's resident memory while suspended, and
`memory_gib` sorts the server's memory that a CRIU image carries (private anonymous and written pages) by where it
lies, once HOT and once SUSPENDED. `server_phases_ms` are the server's own timings of its wake-up (`GET /stats`:
the weights back, the KV cache allocated).
"""

from __future__ import annotations

import asyncio
import contextlib
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
from volga_agent.host import process
from volga_agent.node import instance, server
from volga_agent.snapshot import criu, cuda, lazypages
from volga_agent.worker import contract, regions
from volga_bench import reporting
from volga_core import api

SLEEP = {"afterRestore": [{"method": "POST", "path": "/wake_up"}]}
HOOKS = {"none": {}, "level1": {"beforeCheckpoint": [{"method": "POST", "path": "/sleep?level=1"}], **SLEEP},
         "level2": {"beforeCheckpoint": [{"method": "POST", "path": "/sleep?level=2"}], **SLEEP},
         "level1-freeze2": {"beforeCheckpoint": [{"method": "POST", "path": "/sleep?level=1"}],
                            "beforeFreeze": [{"method": "POST", "path": "/sleep?level=2"}], **SLEEP}}
# FROZEN wakes restore eagerly: lazily (CRIU lazy pages), the driver's restore faults the whole checkpointed
# context in through userfaultfd and took 3.5x longer than an eager restore (level2: 17.3 s against 2.5 s, p50).
# With the driver's copy parked it is mapped from a file instead: lazily then (None: as the instance decides).
LAZY = {"": False, "-parked": None, "-parked-eager": False}
PROMPT = {"prompt": "The tiers of a model instance are", "max_tokens": 32, "stream": True}
CANARY = {"prompt": "canary", "max_tokens": 1}


def way(name: str) -> tuple[str, str]:
    """A way of sleeping's hooks and its restore (`LAZY`'s key): "level2-parked" is ("level2", "-parked")."""
    for hooks in HOOKS:
        for restore in LAZY:
            if name == hooks + restore:
                return hooks, restore
    raise ValueError(f"--hooks: {name}: choose from {', '.join(HOOKS)}, each with {' or '.join(filter(None, LAZY))} "
                     "or without")


def spec(model_dir: pathlib.Path, cache_tokens: int, hooks: str, load_threads: int = 0) -> api.ModelSpecSpec:
    """The server's ModelSpec for a way of sleeping (`way`)."""
    way_hooks, restore = way(hooks)
    parks = ["-m", "volga_agent.worker.handshake"] if restore else []
    return api.ModelSpecSpec.model_validate({
        "modelId": "llm", "framework": "server", "source": str(model_dir),
        "server": {"command": [sys.executable, *parks, "-m", "uvicorn", "volga_bench.servers.llm_app:app", "--port",
                               "{port}", "--loop", "asyncio", "--no-access-log"],
                   "env": {"LLM_MODEL_DIR": str(model_dir), "LLM_CACHE_TOKENS": str(cache_tokens),
                           **({"LLM_LOAD_THREADS": str(load_threads)} if load_threads else {}),
                           "PYTHONPATH": os.pathsep.join(filter(None, [
                               str(pathlib.Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH")]))},
                   "workingDir": str(model_dir), "protocol": "http", "pathPrefix": "/v1",
                   "readiness": {"path": "/health", "timeoutSec": 600, "intervalMs": 20},
                   "hooks": HOOKS[way_hooks],
                   "canary": {"path": "/v1/completions", "body": json.dumps(CANARY)}}})


async def _ask(url: str) -> tuple[float, float, bytes]:
    """(time to first token, time to the whole answer) in ms, and the answer's events."""
    began = time.perf_counter()
    first = 0.0
    body = b""
    async with aiohttp.ClientSession() as session, session.post(
            url + "/v1/completions", json=PROMPT, headers={"x-model-id": "llm"},
            timeout=aiohttp.ClientTimeout(total=900)) as r:
        async for chunk in r.content.iter_any():
            if not first:
                first = time.perf_counter()
            body += chunk
        if r.status != 200:
            raise RuntimeError(f"llm: {r.status} {body[:300]!r}")
    return (first - began) * 1000, (time.perf_counter() - began) * 1000, body


def _rss(pid: int | None) -> int:
    """The resident memory of the tree rooted at `pid`, in bytes."""
    if pid is None:
        return 0
    total = 0
    for member in process.tree(pid):
        try:
            for line in pathlib.Path(f"/proc/{member}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def _mappings_of(pids: list[int], addresses: list[int]) -> list[str]:
    """The processes' mappings that hold any of `addresses`: PID, how many, range, permissions, path."""
    out = []
    for pid in pids:
        with contextlib.suppress(OSError):
            for m in regions.mappings(pid):
                hits = sum(m.start <= a < m.end for a in addresses)
                if hits:
                    out.append(f"{pid} {hits} {m.start:x}-{m.end:x} {m.perms} {m.path}")
    return out


def _memory(pid: int | None) -> dict[str, float]:
    """The tree's memory a CRIU image carries (the `Anonymous` pages of each mapping: private anonymous memory and
    written private file pages), in GiB, by where it lies: the C heap, unnamed mappings, the NVIDIA device files'
    mappings, shared objects, other files; and the largest unnamed mapping."""
    kinds: dict[str, float] = {}
    largest = 0
    for member in process.tree(pid) if pid is not None else []:
        try:
            text = pathlib.Path(f"/proc/{member}/smaps").read_text()
        except OSError:
            continue
        kind = "unnamed"
        for line in text.splitlines():
            fields = line.split()
            if fields and "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
                path = fields[5] if len(fields) > 5 else ""
                kind = ("unnamed" if not path else "heap" if path == "[heap]" else "stack" if path == "[stack]"
                        else "nvidia" if "nvidia" in path else "shared objects" if ".so" in path
                        else "other" if path.startswith("[") else "files")
            elif fields and fields[0] == "Anonymous:":
                size = int(fields[1]) * 1024
                kinds[kind] = kinds.get(kind, 0) + size
                if kind == "unnamed":
                    largest = max(largest, size)
    return {**{k: round(v / 2**30, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "total": round(sum(kinds.values()) / 2**30, 3), "largest unnamed": round(largest / 2**30, 3)}


def _server_stats(instance: server.ServerInstance) -> dict[str, float]:
    """The server's own timings of its last sleep and wake-up (`GET /stats`), off the timed path."""
    answer = instance.call("GET", "/stats")
    return json.loads(answer.body) if answer.status == 200 else {}


def _stats(values: list[float]) -> dict[str, Any]:
    ordered = sorted(values)
    return {"p50": round(statistics.median(ordered), 1),
            "p99": round(ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))], 1),
            "all": [round(v, 1) for v in values]}


def wake_split(moves: list[instance.Transition], first_tokens: list[float]) -> dict[str, dict[str, Any]]:
    """What a tier's wakes spent outside their phases: the agent's own steps around them (`agent_steps`: the move
    less its phases) and, with the first token of each wake's request in the same order, the rest of the request
    beyond the move (`after_wake`: routing, the proxy, the first token's generation)."""
    if not moves:
        return {}
    split = {"agent_steps": _stats([(t.seconds - sum(t.phases.values())) * 1000 for t in moves])}
    if len(first_tokens) == len(moves):
        split["after_wake"] = _stats([first - t.seconds * 1000 for first, t in zip(first_tokens, moves, strict=True)])
    return split


async def _one(hooks: str, model_dir: pathlib.Path, cache_tokens: int, n: int, cold: int, engine: criu.CriuEngine,
               driver: cuda.DriverCheckpoint, work: pathlib.Path, progress: Callable[[str], None],
               load_threads: int = 0, stack_bytes: int = contract.DEFAULT_CUDA_STACK_BYTES) -> dict[str, Any]:
    instance = server.ServerInstance(spec(model_dir, cache_tokens, hooks, load_threads),
                                     work / f"{hooks}-{stack_bytes}", engine, driver=driver,
                                     lazy_restore=LAZY[way(hooks)[1]], cuda_stack_bytes=stack_bytes)
    fleet = server.Fleet([instance])
    runner = web.AppRunner(proxy.app(fleet))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    ttft: dict[str, list[float]] = {"cold": [], "suspended": [], "frozen": []}
    answers: list[bytes] = []
    images: list[int] = []
    parked: list[int] = []  # the parked file's bytes at each freeze
    park_ms: list[float] = []  # the server's moving of the driver's copy into it
    lazy: list[bool] = []
    pages_done: list[float] = []  # a lazy wake's last page delivered, in ms from its request
    lazy_faults: list[float] = []  # with Volga's lazy-pages server: the faults it answered, the bytes it copied
    lazy_first: list[float] = []  # and the MiB it fetched first, from the record of the wake before
    lazy_first_done: list[float] = []  # those in, in ms from the request; the faults by then and in the wake
    lazy_faults_first: list[float] = []
    lazy_faults_wake: list[float] = []
    premap_ms: list[float] = []  # how long faulting the parked copies in took, FROZEN wakes
    # Each read of the server's messages (`lazypages.Read`): [ms from the request, gate wait ms, answered ms,
    # faults, events, first address], per wake; those of every wake that held faults; those within each wake's
    # driver restore.
    lazy_reads: list[list[list[float]]] = []
    reads: list[lazypages.Read] = []
    driver_reads: dict[str, list[float]] = {"reads": [], "faults": [], "events": [], "answered_ms": []}
    lazy_events: list[float] = []
    let_go_mib: list[float] = []  # the mappings with no pages to come it unregistered, and how long that took
    let_go_ms: list[float] = []
    fault_mappings: list[str] = []  # the lines of /proc/PID/maps the faults' addresses fell in, the first lazy wake
    lazy_copied: list[int] = []
    suspended_rss: list[int] = []
    moves: dict[str, list[float]] = {"suspend": [], "freeze": []}
    server_phases: dict[str, dict[str, list[float]]] = {"SUSPENDED": {}, "FROZEN": {}}
    restore_faults: dict[str, list[float]] = {"SUSPENDED": [], "FROZEN": []}
    memory: dict[str, dict[str, float]] = {}

    def phases_of(tier: str) -> None:
        if way(hooks)[0] != "none":
            for key, value in _server_stats(instance).items():
                if key.endswith("_ms"):
                    server_phases[tier].setdefault(key, []).append(value)
        # the page faults of the server's processes during the driver's restore of them
        pids = process.tree(instance.pid) if instance.pid is not None else []
        faults = [driver.timings.get(pid, {}).get("restore_minflt") for pid in pids]
        if any(f is not None for f in faults):
            restore_faults[tier].append(sum(f for f in faults if f is not None))
    try:
        for i in range(cold):
            await asyncio.to_thread(instance.close)
            first, whole, answer = await _ask(url)
            ttft["cold"].append(first)
            answers.append(answer)
            progress(f"llm ({hooks}): cold start {i + 1}/{cold}: first token {first:.0f} ms, answer {whole:.0f} ms")
        if not cold:  # started once, untimed: the cold starts belong to another way of sleeping in this run
            answers.append((await _ask(url))[2])
        memory["HOT"] = _memory(instance.pid)
        process.settled()  # as the agent does once it serves
        for i in range(n):
            began = time.perf_counter()
            await asyncio.to_thread(instance.suspend)
            moves["suspend"].append((time.perf_counter() - began) * 1000)
            suspended_rss.append(_rss(instance.pid))
            if not i:
                memory["SUSPENDED"] = _memory(instance.pid)
            first, whole, answer = await _ask(url)
            ttft["suspended"].append(first)
            answers.append(answer)
            await asyncio.to_thread(phases_of, "SUSPENDED")
            progress(f"llm ({hooks}): SUSPENDED wake {i + 1}/{n}: first token {first:.0f} ms")
        for i in range(n):
            began = time.perf_counter()
            await asyncio.to_thread(instance.freeze)
            moves["freeze"].append((time.perf_counter() - began) * 1000)
            images.append(instance.image.size_bytes if instance.image is not None else 0)
            parked.append(instance.parking.size)
            park_ms += [float(str(r["seconds"])) * 1000 for r in instance.driver_copies.values() if "seconds" in r]
            asked = time.perf_counter()
            first, whole, answer = await _ask(url)
            lazy.append(instance.restored_lazily)
            restored = instance.restored
            pages = await asyncio.to_thread(restored.pages_seconds, 30.0) if restored is not None else None
            if restored is not None and pages is not None:  # every lazy page delivered, from the request's start
                pages_done.append((restored.started + pages - asked) * 1000)
            served = restored.lazy_pages.server if restored is not None and restored.lazy_pages else None
            if served is not None:
                lazy_faults.append(served.faults)
                lazy_copied.append(served.copied)
                lazy_first.append(sum(hi - lo for _, lo, hi in served.order) / 2**20)
                if served.fetched_first_at is not None:
                    lazy_first_done.append((served.fetched_first_at - asked) * 1000)
                    lazy_faults_first.append(served.faults_first)
                lazy_faults_wake.append(served.faults_held)
                lazy_events.append(served.events)
                let_go_mib.append(served.let_go_bytes / 2**20)
                let_go_ms.append(served.let_go_seconds * 1000)
                reads += [r for r in served.reads if r.faults]  # the reads of faults: their waits, as before
                lazy_reads.append([[round((r.at - asked) * 1000, 1), round(r.gate_wait * 1000, 3),
                                    round(r.answered * 1000, 3), r.faults, r.events, r.address] for r in served.reads])
                # the reads while the driver restored the server (the wake's phases, from the request)
                woke = instance.transitions[-1].phases
                lo = asked + woke.get("restore", 0.0)
                hi = lo + woke.get("driver", 0.0)
                during = [r for r in served.reads if lo <= r.at < hi]
                driver_reads["reads"].append(len(during))
                driver_reads["faults"].append(sum(r.faults for r in during))
                driver_reads["events"].append(sum(r.events for r in during))
                driver_reads["answered_ms"].append(round(sum(r.answered for r in during) * 1000, 1))
                if not fault_mappings and instance.pid is not None:  # the mappings the faults were in, once
                    fault_mappings.extend(_mappings_of(process.tree(instance.pid),
                                                       [r.address for r in served.reads if r.faults]))
            for premapped in instance.parking.premapped:  # the parked copies faulted in beside the driver's restore
                if await asyncio.to_thread(premapped.wait, 30.0) and premapped.seconds is not None:
                    premap_ms.append(premapped.seconds * 1000)
            ttft["frozen"].append(first)
            answers.append(answer)
            await asyncio.to_thread(phases_of, "FROZEN")
            progress(f"llm ({hooks}): FROZEN wake {i + 1}/{n}: first token {first:.0f} ms, image "
                     f"{images[-1] / 2**30:.2f} GiB")
        wakes = [t for t in instance.transitions if t.target is api.Tier.HOT and t.source is not api.Tier.COLD]
        phases = {tier.value: {name: _stats([t.phases[name] * 1000 for t in wakes if t.source is tier])
                               for name in ("restore", "driver", "wake")
                               if any(name in t.phases for t in wakes if t.source is tier)}
                  for tier in (api.Tier.SUSPENDED, api.Tier.FROZEN)}
        for tier in (api.Tier.SUSPENDED, api.Tier.FROZEN):
            phases[tier.value].update(wake_split([t for t in wakes if t.source is tier], ttft[tier.value.lower()]))
        fallbacks = sum(t.fallback for t in instance.transitions)
    finally:
        await asyncio.to_thread(fleet.close)
        await runner.cleanup()
    cold_p50 = statistics.median(ttft["cold"]) if ttft["cold"] else None
    frozen_p50 = statistics.median(ttft["frozen"])
    return {"server": "llm-1b", "hooks": hooks, "lazy_restore": all(lazy), "cache_tokens": cache_tokens,
            "load_threads": load_threads or None, "cuda_stack_bytes": stack_bytes,
            "stack_trims": {str(pid): report for pid, report in instance.stack_trims.items()},
            "cold_start_ms": round(cold_p50, 1) if cold_p50 else None,
            "frozen_wake_ms": round(frozen_p50, 1), "suspended_wake_ms": round(statistics.median(ttft["suspended"]), 1),
            "frozen_speedup": round(cold_p50 / frozen_p50, 1) if cold_p50 else None,
            "time_to_first_token_ms": {k: _stats(v) for k, v in ttft.items() if v},
            "wake_phases_ms": phases,
            "server_phases_ms": {tier: {k: _stats(v) for k, v in got.items()} for tier, got in server_phases.items()
                                 if got},
            "suspend_ms": _stats(moves["suspend"]), "freeze_ms": _stats(moves["freeze"]), "memory_gib": memory,
            "image_bytes": int(statistics.median(images)),
            "parked_bytes": int(statistics.median(parked)), "park_ms": _stats(park_ms) if park_ms else None,
            "lazy_pages_done_ms": _stats(pages_done) if pages_done else None,
            "lazy_pages_server": engine.lazy_pages_server if any(lazy) else None,
            "lazy_pages_faults": _stats(lazy_faults) if lazy_faults else None,
            "lazy_pages_fill": engine.fill_for(True) if any(lazy) else None,
            "lazy_pages_first_mib": _stats(lazy_first) if lazy_first else None,
            "lazy_pages_first_done_ms": _stats(lazy_first_done) if lazy_first_done else None,
            "lazy_pages_faults_before_first_done": _stats(lazy_faults_first) if lazy_faults_first else None,
            "lazy_pages_faults_in_wake": _stats(lazy_faults_wake) if lazy_faults_wake else None,
            "lazy_pages_events": _stats(lazy_events) if lazy_events else None,
            "lazy_pages_let_go_mib": _stats(let_go_mib) if let_go_mib else None,
            "lazy_pages_let_go_ms": _stats(let_go_ms) if let_go_ms else None,
            "lazy_pages_reads": lazy_reads or None,
            "lazy_pages_fault_mappings": fault_mappings or None,
            "lazy_pages_gate_wait": reporting.summarize([r.gate_wait for r in reads]) if reads else None,
            "lazy_pages_answer": reporting.summarize([r.answered for r in reads]) if reads else None,
            "lazy_pages_in_driver_restore": {k: _stats(v) for k, v in driver_reads.items()} if lazy_reads else None,
            "premap_ms": _stats(premap_ms) if premap_ms else None,
            "driver_restore_minflt": {tier: _stats(got) for tier, got in restore_faults.items() if got},
            "lazy_pages_copied_bytes": int(statistics.median(lazy_copied)) if lazy_copied else None,
            "suspended_host_bytes": int(statistics.median(suspended_rss)),
            "identical": fallbacks == 0 and all(a == answers[0] for a in answers), "restore_fallbacks": fallbacks,
            "answer": answers[0].decode()[:400]}


def bench(n: int = 10, cold: int = 3, hooks: list[str] | None = None, cache_tokens: int = 32768,
          models: str | None = None, progress: Callable[[str], None] = lambda _: None,
          load_threads: int = 0, stack_bytes: list[int] | None = None) -> dict[str, Any]:
    """Every way of sleeping in `hooks` (default: all) with each CUDA stack in `stack_bytes` (the per-thread stack the
    server's contexts are lowered to before each driver checkpoint where it runs through the handshake; 0: its own;
    default: the agent's), one after another on one GPU; the cold starts with the first only (neither plays a part
    in a cold start)."""
    from volga_bench.servers import llm_model  # torch and transformers: the GPU machine's

    hooks = hooks or list(HOOKS)
    for name in hooks:
        way(name)  # ValueError naming it
    model_dir = pathlib.Path(models or tempfile.gettempdir()) / "volga-llm-1b"
    began = time.perf_counter()
    llm_model.make_model(model_dir)
    progress(f"model in {model_dir} ({(time.perf_counter() - began):.1f} s)")
    engine_root = pathlib.Path(tempfile.mkdtemp(prefix="volga-bench-llm-", dir="/dev/shm"))
    work = pathlib.Path(tempfile.mkdtemp(prefix="vbl-"))
    driver = cuda.DriverCheckpoint()
    try:
        engine = criu.CriuEngine(engine_root / "criu", criu=criu.find_criu())
        ways = [(h, b) for h in hooks for b in (stack_bytes or [contract.DEFAULT_CUDA_STACK_BYTES])]
        with reporting.parked_huge_pages(engine.root / instance.PARKED) as on_huge:
            results = [asyncio.run(_one(h, model_dir, cache_tokens, n, cold if i == 0 else 0, engine, driver, work,
                                        progress, load_threads, b)) for i, (h, b) in enumerate(ways)]
        cold_ms = results[0]["cold_start_ms"]
        for r in results[1:]:
            r["frozen_speedup"] = round(cold_ms / r["frozen_wake_ms"], 1) if cold_ms else None
        return {"bench": "server-gpu", "n": n, "cold_starts": cold, "device": reporting.device_description("cuda"),
                "driver_api": driver.driver_api, "criu": engine.version().removeprefix("Version: "),
                "kernel": platform.release(), "cpus": os.cpu_count(), "parked_huge_pages": on_huge,
                "criu_breakpoints": engine.breakpoints,
                "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": results}
    finally:
        shutil.rmtree(engine_root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
