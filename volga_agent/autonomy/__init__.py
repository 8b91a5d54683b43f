"""The node autonomy loop: the SLO contract of each ModelSpec acted on by the node itself, every 100 ms.

`sampler` reads the node (GPU utilisation, memory and PCIe through NVML; CPU, memory and pressure stall
information on a CPU node) and the gateway's per-model load every few milliseconds and hands fixed-size
`window.Window`s on; `decider` turns each window into a state (PRELOAD, ACCEPT, OPTIMIZE, EMERGENCY) and a list
of actions, purely; `loop` runs both and applies the actions: wakes and demotions through the pool, batch caps
and shedding through the gateway, which it reaches only through the `loop.Gateway` protocol (the package sits
beside the gateway and imports nothing of it; see docs/architecture.md).
"""
