"""`volga bench decide`: what one autonomy decision costs, with 2 to 64 models, and how steady the sampling is.

The decider runs over synthetic windows that walk every path: memory sweeping through the watermarks (so the state
moves through PRELOAD, ACCEPT, OPTIMIZE and EMERGENCY), models whose arrivals accelerate, models violating their SLO
(some past their recovery deadline), idle ones. Each decision is timed alone (perf_counter_ns) after a warm-up; the
budget is 50 us at the p99. Each decision is timed twice over: by the wall clock, which on a loaded machine includes
the times the thread was preempted, and by the thread's CPU clock (thread_time_ns), which is what the decision
itself costs; the load average is reported beside them. The sampler then runs on this node's real probe (NVML or
/proc) for a few seconds, and its jitter (how late each sample came against its schedule) is reported.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable
from typing import Any

from volga_agent.autonomy import decider, sampler, window
from volga_agent.node.settings import Settings
from volga_core import api

BUDGET_US = 50.0
MODEL_COUNTS = (2, 4, 8, 16, 32, 64)
WINDOW_S = 0.1


def synthetic(models: int, count: int, seed: int = 7) -> tuple[dict[str, decider.ModelView], list[window.Window]]:
    """Views of `models` models and `count` windows of their load."""
    rng = random.Random(seed)
    views = {}
    for i in range(models):
        name = f"model-{i:02d}"
        steps = [{"belowLoadPct": 50, "pct": 10 + 5 * (i % 4)}, {"pct": 40 + 10 * (i % 5)}] if i % 2 else []
        contract = api.Slo.model_validate({"interferenceTolerancePct": 10 + 20 * (i % 6), "recoveryDeadlineMs": 300,
                                           "interferenceTolerance": steps})
        views[name] = decider.ModelView(name, contract, ((1, 2.0), (8, 5.0)), awake=i % 3 != 0, gpu=i % 2 == 0)
    windows = []
    for k in range(count):
        memory = 50 + 45 * math.sin(k / 40)  # 5 % .. 95 %: every watermark, both ways
        loads = {}
        for i, name in enumerate(views):
            rate = 5 + (k % 30) ** (1 + (i % 3) / 2) if i % 5 else 0  # some accelerate, some idle
            arrivals = int(rate * WINDOW_S) + rng.randint(0, 2)
            p99 = 5.0 * (1.0 + rng.random() * (0.6 if (k // 25 + i) % 4 == 0 else 0.1))
            loads[name] = window.ModelWindow(arrivals, arrivals, rng.randint(0, 3), 0, p99 if arrivals else None)
        # As the sampler's windows (window.build), with the completed requests counted.
        windows.append(window.Window(k * WINDOW_S, (k + 1) * WINDOW_S, memory, rng.uniform(10, 90), False, loads,
                                     completed=sum(w.completed for w in loads.values())))
    return views, windows


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def time_decisions(models: int, count: int) -> dict[str, Any]:
    views, windows = synthetic(models, count)
    decide = decider.Decider(Settings()).decide
    for built in windows[:200]:
        decide(built, views)
    costs: list[float] = []
    cpu: list[float] = []
    states: set[str] = set()
    actions: set[str] = set()
    clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    for built in windows:
        cpu_start = cpu_clock()
        start = clock()
        decision = decide(built, views)
        ended = clock()
        cpu.append((cpu_clock() - cpu_start) / 1e3)
        costs.append((ended - start) / 1e3)
        states.add(decision.state.value)
        actions.update(type(a).__name__ for a in decision.actions)
    return {"models": models, "decisions": len(costs), "p50_us": round(percentile(costs, 0.5), 2),
            "p99_us": round(percentile(costs, 0.99), 2), "max_us": round(max(costs), 2),
            "cpu_p50_us": round(percentile(cpu, 0.5), 2), "cpu_p99_us": round(percentile(cpu, 0.99), 2),
            "within_budget": percentile(costs, 0.99) <= BUDGET_US, "states": sorted(states),
            "actions": sorted(actions)}


def sample_jitter(seconds: float, period_ms: float) -> dict[str, Any]:
    probe = sampler.probe_for_node()
    run = sampler.Sampler(probe, period_ms=period_ms)
    run.start()
    time.sleep(seconds)
    run.stop()
    p50, p99 = run.jitter()
    return {"probe": type(probe).__name__, "period_ms": period_ms, "samples": len(run.jitter_ms),
            "jitter_p50_ms": round(p50, 3), "jitter_p99_ms": round(p99, 3), "missed_slots": run.missed}


def run(windows: int = 2000, sample_seconds: float = 2.0, period_ms: float = 10.0,
        progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    results = []
    for models in MODEL_COUNTS:
        progress(f"deciding {windows} windows of {models} models ...")
        results.append(time_decisions(models, windows))
    progress(f"sampling this node every {period_ms:g} ms for {sample_seconds:g} s ...")
    return {"budget_p99_us": BUDGET_US, "load_average": [round(x, 2) for x in os.getloadavg()],
            "cpus": os.cpu_count(), "decide": results,
            "sampler": sample_jitter(sample_seconds, period_ms) if sample_seconds > 0 else None,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def format_report(report: dict[str, Any]) -> str:
    lines = [f"load average {report['load_average']} on {report['cpus']} CPUs",
             f"{'models':>7}{'p50 us':>9}{'p99 us':>9}{'max us':>9}{'cpu p50':>9}{'cpu p99':>9}"
             f"  within {report['budget_p99_us']:g} us"]
    for r in report["decide"]:
        lines.append(f"{r['models']:>7}{r['p50_us']:>9.2f}{r['p99_us']:>9.2f}{r['max_us']:>9.2f}"
                     f"{r['cpu_p50_us']:>9.2f}{r['cpu_p99_us']:>9.2f}  {r['within_budget']}")
    s = report["sampler"]
    if s:
        lines.append(f"sampler ({s['probe']}, every {s['period_ms']:g} ms, {s['samples']} samples): jitter p50 "
                     f"{s['jitter_p50_ms']:.3f} ms, p99 {s['jitter_p99_ms']:.3f} ms, {s['missed_slots']} slots missed")
    return "\n".join(lines)
