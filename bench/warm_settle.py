"""Does a WARM wake right after the demotion run slower (the driver still clearing the memory it freed)?

On the GPU machine: python3 bench/warm_settle.py (bench/results/tiers/warm-settle-h200.txt). A 2 and an 8 GiB arena
(vmm.Arena, as a WARM worker holds its weights) is copied out, released, and mapped and filled again chunk by
chunk as a WARM wake does: at once, and after 50 ms, 0.3 s and 1 s. Median of 5, ms.
"""

import json
import statistics
import time

import torch

from volga_agent.worker import vmm


def refill_ms(arena: vmm.Arena, device: torch.Tensor, host: torch.Tensor, settle_s: float) -> float:
    host.copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    arena.unmap()
    time.sleep(settle_s)
    start = time.perf_counter()
    for index in range(len(arena.chunks)):
        offset, size = arena.map_chunk(index)
        end = min(offset + size, arena.nbytes)
        device[offset:end].copy_(host[offset:end], non_blocking=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    torch.cuda.init()
    torch.empty(1, device="cuda:0")
    out = {}
    for gib in (2, 8):
        nbytes = gib * 2**30
        host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        arena = vmm.Arena(nbytes, 0)
        device = arena.tensor(torch)
        for settle_s in (0.0, 0.05, 0.3, 1.0):
            ms = statistics.median(refill_ms(arena, device, host, settle_s) for _ in range(5))
            out[f"{gib}GiB settle {settle_s}s"] = round(ms, 2)
            print(gib, settle_s, round(ms, 2), flush=True)
        arena.unmap()
        del host
    print(json.dumps(out))


if __name__ == "__main__":
    main()
