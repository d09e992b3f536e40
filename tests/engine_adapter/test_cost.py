"""The arithmetic of cost-to-serve (``engine_adapter.cost``): whatever the requests, an
engine-interval's GPU time and its cost are split with nothing lost or made up.

The live checks (the simulator and real SGLang behind the gateway, the attribution task) are in
``tests/metering/test_cost_to_serve.py``; these pin the split itself on arbitrary inputs.
"""

from __future__ import annotations

from decimal import Decimal

from hypothesis import given, settings
from hypothesis import strategies as st

from engine_adapter.cost import PLACES, US, Throughput, Work, largest_remainder, split_interval

A, B = 1_000 * US, 1_060 * US  # a one-minute interval
RATES = Throughput(Decimal("20000"), Decimal("100"))


@st.composite
def works(draw: st.DrawFn) -> list[Work]:
    out = []
    for key in range(draw(st.integers(0, 12))):
        start = draw(st.integers(A - 120 * US, B + 10 * US))
        length = draw(st.integers(0, 200 * US))
        out.append(Work(key=key, start_us=start, end_us=start + length,
                        uncached_tokens=draw(st.integers(0, 50_000)),
                        decode_tokens=draw(st.integers(0, 5_000))))
    return out


@settings(max_examples=300, deadline=None)
@given(works=works(), gpus=st.integers(1, 8),
       price=st.decimals(min_value=0, max_value=100, places=6))
def test_attributed_plus_idle_is_interval_times_gpus_exactly(works, gpus, price):
    split = split_interval(start_us=A, end_us=B, gpus=gpus, gpu_hourly_cost=price,
                           works=works, throughput=RATES)

    assert split.capacity_us == (B - A) * gpus
    assert split.attributed_us + split.idle_us == split.capacity_us
    assert sum(split.shares.values()) == split.attributed_us
    assert split.capacity_cost == (Decimal(split.capacity_us) * price / 3_600_000_000).quantize(
        PLACES)
    assert sum(split.share_costs.values(), Decimal(0)) + split.idle_cost == split.capacity_cost
    assert all(cost >= 0 for cost in split.share_costs.values()) and split.idle_cost >= 0
    # only requests active in the interval get a share, and none gets more than the interval
    for key, gpu_us in split.shares.items():
        work = works[key]
        assert work.end_us >= A and work.start_us < B
        assert gpu_us <= (B - A) * gpus


def test_a_lone_request_gets_its_busy_time_and_two_at_once_share_by_their_work():
    # given one request busy for 20 s of the minute, on 2 GPUs
    lone = [Work(key=1, start_us=A + 10 * US, end_us=A + 30 * US, uncached_tokens=100,
                 decode_tokens=200)]
    split = split_interval(start_us=A, end_us=B, gpus=2, gpu_hourly_cost=Decimal("3.6"),
                           works=lone, throughput=RATES)
    assert split.shares == {1: 40 * US} and split.idle_us == 80 * US
    assert split.share_costs[1] == Decimal("0.04")  # 40 GPU-seconds at $3.60 an hour

    # when a second request with twice the decode tokens runs over the same 20 s
    both = [*lone, Work(key=2, start_us=A + 10 * US, end_us=A + 30 * US, uncached_tokens=100,
                        decode_tokens=400)]
    split = split_interval(start_us=A, end_us=B, gpus=2, gpu_hourly_cost=Decimal("3.6"),
                           works=both, throughput=RATES)

    # then the busy time is the same and the second gets about twice the first's share
    assert split.attributed_us == 40 * US
    assert 1.95 < split.shares[2] / split.shares[1] < 2.05


def test_a_request_spanning_intervals_gets_its_share_of_each():
    work = [Work(key=7, start_us=A + 50 * US, end_us=A + 70 * US, uncached_tokens=0,
                 decode_tokens=1000)]
    first = split_interval(start_us=A, end_us=B, gpus=1, gpu_hourly_cost=Decimal(1),
                           works=work, throughput=RATES)
    second = split_interval(start_us=B, end_us=B + 60 * US, gpus=1,
                            gpu_hourly_cost=Decimal(1), works=work, throughput=RATES)

    assert first.shares == {7: 10 * US} and second.shares == {7: 10 * US}


def test_largest_remainder_is_exact_and_deterministic():
    assert largest_remainder(10, [1, 1, 1]) == [4, 3, 3]  # the tie goes to the earlier part
    assert largest_remainder(7, [0, 2, 5]) == [0, 2, 5]
    assert largest_remainder(0, [0, 0]) == [0, 0]
    assert sum(largest_remainder(10**12 + 7, [3, 5, 11, 13])) == 10**12 + 7
