"""The bookkeeping of `snapshot.lazypages` that needs no restore: a wake's record merged, pages taken by range."""

from __future__ import annotations

from volga_agent.snapshot import criu, lazypages

K = 1024


def test_a_record_merges_neighbours_and_keeps_the_order_of_first_need() -> None:
    wanted = [(1, 200 * K, 264 * K), (1, 0, 64 * K), (2, 64 * K, 128 * K), (1, 64 * K, 128 * K),
              (1, 136 * K, 200 * K), (2, 0, 64 * K), (1, 100 * K, 120 * K)]
    # 0-128 K of process 1 (wanted second), 136-264 K (wanted first), 0-128 K of process 2 (third); not 128-136 K
    assert lazypages.coalesce(wanted) == [(1, 136 * K, 264 * K), (1, 0, 128 * K), (2, 0, 128 * K)]
    assert lazypages.coalesce([]) == []


def test_pages_are_taken_within_a_range_and_the_rest_stays_to_come() -> None:
    space = lazypages._Space(1, -1, None, [[0, 100 * K, 0], [200 * K, 300 * K, 100 * K]])  # type: ignore[arg-type]
    assert space.overlaps(90 * K, 210 * K) and not space.overlaps(100 * K, 200 * K)
    assert space.take_within(50 * K, 250 * K, 1024 * K) == [50 * K, 100 * K, 50 * K]
    assert space.take_within(50 * K, 250 * K, 16 * K) == [200 * K, 216 * K, 100 * K]
    assert space.take_within(50 * K, 250 * K, 1024 * K) == [216 * K, 250 * K, 116 * K]
    assert space.take_within(50 * K, 250 * K, 1024 * K) is None
    assert space.pending == [[0, 50 * K, 0], [250 * K, 300 * K, 150 * K]]


def test_auto_holds_the_fill_for_a_wake_on_the_cpu_only_and_fills_a_gpu_process_record_first() -> None:
    for fill, cpu, gpu in (("auto", "after-wake", "record-first"), ("after-wake", "after-wake", "after-wake"),
                           ("record-first", "record-first", "record-first"), ("at-once", "at-once", "at-once")):
        assert (criu.resolve_fill(fill, False), criu.resolve_fill(fill, True)) == (cpu, gpu)
