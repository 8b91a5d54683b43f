"""The LLM server's own sleep and wake-up, phase by phase, in one process without Volga.

`volga bench server --gpu` times a wake through Volga: the driver's restore, then the server's `POST /wake_up`
(`volga_bench/servers/llm_app.py`) and the canary. This runs the server's engine alone: it sleeps at level 1 and 2
and wakes up again, with several loading thread counts, and reports the median of each phase the server keeps in
`/stats` (the weights' allocation, the staging buffers' pinning, the weights' copy, the KV cache). It then times
what the KV cache phase holds: the cache's construction, and the one-token forward that makes a lazily allocated
cache take its memory, beside a second forward (what a one-token completion such as the canary costs).

On the GPU machine: python3 bench/llm_wake_up.py --model-dir /dev/shm/llm --out FILE.json
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from typing import Any

import benchio  # bench/, beside this script


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default="/dev/shm/llm", help="the model folder (written when missing)")
    parser.add_argument("--threads", default="12,6,16,24", help="loading thread counts, comma-separated")
    parser.add_argument("-n", type=int, default=6, help="wake-ups per level and thread count (the first not counted)")
    parser.add_argument("--out")
    args = parser.parse_args()
    os.environ["LLM_MODEL_DIR"] = args.model_dir
    import torch

    from volga_bench.servers import llm_model
    llm_model.make_model(args.model_dir)
    from volga_bench.servers import llm_app  # its engine loads the model at import

    engine = llm_app.engine
    report: dict[str, Any] = {"bench": "llm-wake-up", "device": torch.cuda.get_device_name(0),
                              "cache_tokens": engine.cache_tokens, "weights_bytes": engine.size, "levels": {}}
    for level in (2, 1):
        for threads in (int(t) for t in args.threads.split(",")):
            engine.threads = threads
            runs = []
            for _ in range(args.n):
                engine.sleep(level)
                time.sleep(0.2)
                engine.wake_up()
                runs.append(dict(engine.stats))
            key = f"level{level}-threads{threads}"
            report["levels"][key] = {k: round(statistics.median(r[k] for r in runs[1:]), 1) for k in runs[0]}
            print(key, report["levels"][key], flush=True)

    def forward(cache: Any, position: int) -> float:
        began = time.perf_counter()
        with torch.inference_mode():
            engine.model(input_ids=torch.zeros((1, 1), dtype=torch.long, device="cuda"), past_key_values=cache,
                         cache_position=torch.full((1,), position, dtype=torch.long, device="cuda"), use_cache=True)
        torch.cuda.synchronize()
        return (time.perf_counter() - began) * 1e3

    splits = []
    for _ in range(4):
        engine.cache = None
        gc.collect()
        torch.cuda.empty_cache()
        began = time.perf_counter()
        cache = engine.new_cache()
        torch.cuda.synchronize()
        construct = (time.perf_counter() - began) * 1e3
        splits.append({"construct_ms": round(construct, 1), "first_forward_ms": round(forward(cache, 0), 1),
                       "second_forward_ms": round(forward(cache, 1), 1)})
        engine.cache = cache
    report["kv_cache_phase"] = splits
    benchio.emit(report, args.out)


if __name__ == "__main__":
    main()
