"""Benchmarks, the demo and the real control plane the tests and the scale bench run against.

Not part of the product: the node and operator images do not carry it, and its extra dependencies come with
`pip install 'volga[bench]'`. Only `volga_agent.cli` imports it, lazily, for its `bench` and `demo` commands
(volga_bench/commands.py).
"""
