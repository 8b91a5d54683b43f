"""kopf's handlers: kopf runs the process (startup, cleanup, the liveness endpoint, signals), and these hand the
rest to the reconcile loop (`loop.Loop`, which says why kopf's resource handlers are not used).

At startup: the operator's settings (from `__main__`, in the memo; read from the environment when kopf runs this
module itself), the loop, its /metrics endpoint, the watches (listed in full before the first pass) and the loop's
task; at cleanup, all of it stopped again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import kopf

from volga_core import http
from volga_operator import loop as reconcile_loop
from volga_operator import settings as operator_settings

log = logging.getLogger("volga.operator")

SETTINGS_KEY = "volga_settings"  # the memo key `__main__` puts the operator's settings under
LOOP_KEY = "loop"


def _loop(memo: kopf.Memo) -> reconcile_loop.Loop:
    return memo[LOOP_KEY]  # type: ignore[no-any-return]


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    settings.posting.level = logging.WARNING
    ours: operator_settings.Settings = memo.get(SETTINGS_KEY) or operator_settings.Settings.from_environ()
    loop = reconcile_loop.Loop(ours)
    memo[LOOP_KEY] = loop
    if ours.metrics_port >= 0:
        tokens = http.Tokens.from_file(ours.metrics_token_file) if ours.metrics_token_file else None
        memo["metrics"], port = await loop.metrics.serve(ours.metrics_host, ours.metrics_port, tokens)
        log.info("metrics on %s:%d%s", ours.metrics_host, port, " (bearer token required)" if tokens else "")
    await loop.start_watching()
    memo["task"] = asyncio.get_running_loop().create_task(loop.run(), name="volga-reconcile")
    logger.info("volga operator: API writes limited to %.0f/s; chains leave a node in EMERGENCY after %g s, at most "
                "once per %g s", ours.api_writes_per_sec, ours.chain_migration_after_sec,
                ours.chain_migration_min_interval_sec)


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    if LOOP_KEY in memo:
        _loop(memo).stop_watching()
    task = memo.get("task")
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    runner = memo.get("metrics")
    if runner is not None:
        await runner.cleanup()
