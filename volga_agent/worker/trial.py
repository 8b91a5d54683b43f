"""One run of a model's warm-up outside any agent, for `volga validate --run`: load the model as a worker would, run
each warm-up sample once, and say what the warm-up found.

    python -m volga_agent.worker.trial CONFIG.json

prints one JSON object: {"report": `contract.WarmupReport.to_wire()`} when the model loaded and the warm-up ran (or
its made-up sample was skipped), {"error": "..."} when the model did not load or refused a declared sample (exit
status 1). It runs in a process of its own, so that a model that crashes or hangs takes only that process.

Like everything under `volga_agent.worker`, this imports nothing of the agent (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys

from volga_agent.worker import backends, contract, warmup


def trial(config: contract.WorkerConfig) -> contract.WarmupReport:
    """Load the model and run each warm-up sample once; WarmupError when a declared sample is refused."""
    backend = backends.load_backend(dataclasses.replace(config, warmup_iterations=1))
    return warmup.warm_up(backend.run, dataclasses.replace(config, warmup_iterations=1))[1]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m volga_agent.worker.trial CONFIG.json", file=sys.stderr)
        return 2
    config = contract.WorkerConfig.from_json(pathlib.Path(argv[0]).read_text())
    try:
        report = trial(config)
    except Exception as exc:  # the model's own failure, whatever its framework raises: said, not raised
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    print(json.dumps({"report": report.to_wire()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
