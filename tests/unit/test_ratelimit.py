from __future__ import annotations

import asyncio
import bisect
import types

import pytest

from volga_core.kube import ratelimit


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_bucket_never_exceeds_rate_plus_burst_in_a_second() -> None:
    clock = Clock()
    bucket = ratelimit.TokenBucket(180, 20, clock)
    waits = [bucket._reserve() for _ in range(1000)]
    assert waits[:20] == [0.0] * 20
    assert waits[20] == pytest.approx(1 / 180)
    assert waits[-1] == pytest.approx((1000 - 20) / 180)
    # The writes start at these times (the clock stands still): never more than 200 in any second.
    assert max(bisect.bisect_right(waits, at + 1.0 - 1e-9) - i for i, at in enumerate(waits)) <= 200


def test_within_a_limit_splits_it_into_burst_and_rate() -> None:
    bucket = ratelimit.TokenBucket.within(200)
    assert (bucket.rate, bucket.burst) == (180, 20)


def test_bucket_refills() -> None:
    clock = Clock()
    bucket = ratelimit.TokenBucket(10, 2, clock)
    assert [bucket._reserve() for _ in range(2)] == [0.0, 0.0]
    clock.now = 10.0
    assert bucket._reserve() == 0.0


class Flaky(Exception):
    def __init__(self, status: int) -> None:
        self.status = status


def test_write_retries_retryable_errors_only() -> None:
    bucket = ratelimit.TokenBucket(1000, 100)
    calls: list[int] = []

    async def sometimes() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise Flaky(429)
        return "ok"

    assert asyncio.run(ratelimit.write(bucket, sometimes, base_delay=0.001)) == "ok"
    assert len(calls) == 3

    async def invalid() -> str:
        raise Flaky(422)

    with pytest.raises(Flaky):
        asyncio.run(ratelimit.write(bucket, invalid, base_delay=0.001))
    with pytest.raises(ValueError, match="rate must be positive"):
        ratelimit.TokenBucket(0)


def test_write_sync_gives_up_after_the_last_attempt_with_its_error() -> None:
    bucket = ratelimit.TokenBucket(1000, 100)
    calls: list[int] = []

    def down() -> str:
        calls.append(1)
        raise Flaky(503)

    with pytest.raises(Flaky):
        ratelimit.write_sync(bucket, down, base_delay=0.001)
    assert len(calls) == 6


def test_retry_delays_double_up_to_the_cap_jittered_between_half_and_all() -> None:
    wait = ratelimit._retrying(6, 0.2, 10.0)["wait"]
    for failures in range(1, 12):
        full = min(10.0, 0.2 * 2 ** (failures - 1))
        delays = [wait(types.SimpleNamespace(attempt_number=failures)) for _ in range(50)]
        assert all(full / 2 <= d <= full for d in delays), (failures, min(delays), max(delays))
