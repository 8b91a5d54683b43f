"""`volga bench scale` end to end at a small size, on its real parts (etcd, kube-apiserver with its audit log, kwok
nodes, the operator as a process): the operator's writes as the bench counts them are the two EMI creations and
the one status write of each ModelSpec, within the write limit, and a restart on the converged cluster writes
nothing."""

from __future__ import annotations

import pytest

from volga_bench import scale

pytestmark = pytest.mark.slow


def test_the_bench_counts_three_writes_per_modelspec_within_the_limit() -> None:
    limit = 40.0
    report = scale.run(nodes=4, modelspecs=24, writes_per_sec=limit, timeout=240)
    assert report["operator_writes_by_request"] == {"POST executablemodelinstances": 48,
                                                    "PATCH modelspecs/status": 24}
    assert report["writes_per_modelspec"] == 3.0
    assert report["write_floor_s"] == 72 / limit
    assert 0 < report["peak_writes_per_s"] <= limit
    assert report["restart_writes"] == 0
    assert report["operator_peak_rss_mib"] > 0 and report["operator_cpu_s"] > 0
    assert report["emis"] == 48 and report["kwok_nodes_ready"]
