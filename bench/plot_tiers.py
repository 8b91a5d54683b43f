"""Plot wake -> first answer against model size per tier, with the host-to-device copy limit, from the
committed GPU results; print the Markdown table the README and docs/measurements.md carry.

    python bench/plot_tiers.py bench/results/tiers/tiers-gpu-h200-*.json --out bench/results/tiers/tiers-gpu-h200.png
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

TIERS = ("warm", "suspended", "frozen_lazy", "frozen", "cold")  # FROZEN lazy where measured (`--lazy`)
GIB = 2**30


def load(paths: list[str]) -> tuple[list[tuple[float, dict[str, Any]]], dict[str, float], dict[str, Any] | None]:
    """Points (GiB, size report with the copy limits of its run), the slowest run's limits, the burst.

    Several files may measure the same size: a tier measured again (as many or more wakes) in a file named
    later replaces the earlier measurement, together with that file's copy limits.
    """
    merged: dict[int, dict[str, Any]] = {}
    limits: dict[str, float] = {}
    burst = None
    for path in paths:
        report = json.loads(pathlib.Path(path).read_text())
        own = report.get("copy_limits") or {}
        if not limits or own.get("pinned_h2d_gbps", 1e9) < limits.get("pinned_h2d_gbps", 1e9):
            limits = own
        burst = report.get("burst") or burst
        for size in report["sizes"].values():
            key = size["model"]["weights_bytes"]
            entry = merged.setdefault(key, {**size, "tiers": {}, "limits_of": {}})
            for tier, result in size["tiers"].items():
                if tier not in entry["tiers"] or result["n"] >= entry["tiers"][tier]["n"]:
                    entry["tiers"][tier] = result
                    entry["limits_of"][tier] = own
    points = [(key / GIB, entry) for key, entry in merged.items()]
    return sorted(points, key=lambda p: p[0]), limits, burst


def measured(points: list[tuple[float, dict[str, Any]]]) -> list[str]:
    """The tiers of TIERS that every size was measured in."""
    return [tier for tier in TIERS if all(tier in size["tiers"] for _, size in points)]


def table(points: list[tuple[float, dict[str, Any]]]) -> str:
    rows = ["| weights | pinned copy limit (that run) | tier | p50 ms | p99 ms | n | p99 / copy limit "
            "| vs cold p50 |",
            "|---|---|---|---|---|---|---|---|"]
    for gib, size in points:
        cold = size["tiers"]["cold"]["p50_ms"]
        for tier in measured(points):
            r = size["tiers"][tier]
            pinned = size["limits_of"][tier].get("pinned_h2d_gbps", 0.0)
            limit_ms = gib * GIB / (pinned * 1e9) * 1e3 if pinned else float("nan")
            name = tier.upper().replace("_", " ")
            rows.append(f"| {gib:.2f} GiB | {limit_ms:.1f} ms ({pinned:g} GB/s) | {name} "
                        f"| {r['p50_ms']:.1f} | {r['p99_ms']:.1f} "
                        f"| {r['n']} | {r['p99_ms'] / limit_ms:.1f}x | {cold / r['p50_ms']:.1f}x |")
    return "\n".join(rows)


def plot(points: list[tuple[float, dict[str, Any]]], limits: dict[str, float], out: pathlib.Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [gib for gib, _ in points]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for tier, marker in zip(TIERS, "osvD^", strict=True):
        if tier not in measured(points):
            continue
        p50 = [s["tiers"][tier]["p50_ms"] for _, s in points]
        p99 = [s["tiers"][tier]["p99_ms"] for _, s in points]
        ax.plot(sizes, p50, marker=marker, label=f"{tier.upper().replace('_', ' ')} p50")
        ax.fill_between(sizes, p50, p99, alpha=0.15)
    for kind, style in (("pinned", "k--"), ("pageable", "k:")):
        rate = limits.get(f"{kind}_h2d_gbps")
        if rate:
            ax.plot(sizes, [g * GIB / (rate * 1e9) * 1e3 for g in sizes], style,
                    label=f"{kind} H2D copy limit ({rate:g} GB/s, slowest run)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(sizes, [f"{g:.2g}" for g in sizes])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("model weights (GiB)")
    ax.set_ylabel("wake -> first answer (ms); band: p50..p99")
    ax.set_title("Volga tiers on one NVIDIA H200")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("results", nargs="+")
    parser.add_argument("--out", default="bench/results/tiers/tiers-gpu-h200.png")
    args = parser.parse_args()
    points, limits, burst = load(args.results)
    plot(points, limits, pathlib.Path(args.out))
    print(table(points))
    if burst:
        print(f"\nburst: {burst['instances']} SUSPENDED models woken at once, all answered in "
              f"{burst['all_answered_ms']:.0f} ms (one after another: {burst['sequential_total_ms']:.0f} ms)")


if __name__ == "__main__":
    main()
