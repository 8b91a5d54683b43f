"""Whether this machine's NVIDIA driver answers NVML: the GPU discovery tests on a real GPU need it, the ones
without a driver need it not to."""

from __future__ import annotations

import pynvml


def nvml_loads() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True
