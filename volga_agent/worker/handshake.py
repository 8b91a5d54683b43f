"""The checkpoint handshake for model servers Volga runs (`ServerSpec.hooks.signalFiles`), in two lines:

    from volga_agent.worker import handshake
    handshake.checkpoint_here()   # once the engine is loaded, before the server opens its sockets

Under Volga ($VOLGA_SIGNAL_DIR set) this writes `ready-for-checkpoint` into that folder and waits until
`restore-complete` appears: Volga takes the server's image meanwhile, and every wake restores it and writes the
file, so the call returns in each restored copy (and once in the process that was started). Elsewhere it returns
at once. Only the standard library: the server's process imports it, and it is what gets frozen.
"""

from __future__ import annotations

import os
import pathlib
import time

SIGNAL_DIR_ENV = "VOLGA_SIGNAL_DIR"
READY = "ready-for-checkpoint"
RESTORED = "restore-complete"


def checkpoint_here(poll_sec: float = 0.001) -> bool:
    """Offer this point to Volga for its image and wait until it says go on; False when not run by Volga."""
    folder = os.environ.get(SIGNAL_DIR_ENV)
    if not folder:
        return False
    signals = pathlib.Path(folder)
    (signals / RESTORED).unlink(missing_ok=True)
    ready = signals / READY
    ready.with_suffix(".tmp").write_text(str(os.getpid()))
    ready.with_suffix(".tmp").rename(ready)  # complete when it appears
    done = signals / RESTORED
    while not done.exists():
        time.sleep(poll_sec)
    return True
