"""Cost-to-serve from the engines' GPU time, against simulated engines behind the live gateway.

Per engine and interval the engine's GPU time (interval x GPUs) goes to the requests it served
there, in proportion to their work as the engine's own measured throughput weighs it, and the
rest is idle: attributed + idle = interval x GPUs to the microsecond, in every interval, and
the same for the cost. Requests here run for over a second against 1-second intervals, so each
spans several. Real SGLang: ``test_cost_to_serve_sglang.py``.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db.models import Count, Sum
from django.utils import timezone

from engine_adapter.cost import PLACES
from engine_adapter.sim.testing import start_sim
from metering import costs
from metering.choices import ThroughputSource
from metering.events import UsageEventData, new_request_id
from metering.models import (
    UsageCostInterval,
    UsageCostShare,
    UsageEvent,
    UsageRollupHourly,
)
from metering.recording import record_events
from metering.selectors import usage_event_costs, usage_pool_capacity
from tests.conftest import wait_until
from tests.gateway.conftest import drain_usage
from tests.metering.engine_stack import engine_stack, scrape

MODEL = "small"
SLOW = {"prefill_tokens_per_s": 20_000, "decode_tokens_per_s": 100, "max_running_requests": 8}


@pytest.fixture
def sims():
    started = {"small-a": start_sim(served_model_name=MODEL, **SLOW),
               "small-b": start_sim(served_model_name=MODEL, **SLOW),
               # up and scraped, but serving a model nobody asks for: idle throughout
               "spare": start_sim(served_model_name="spare-model", **SLOW)}
    yield started
    for sim in started.values():
        sim.stop()


def assert_conserved(intervals) -> None:
    """Every interval: attributed + idle = length x GPUs, shares sum to the attributed part,
    and their costs plus the idle cost are the interval's GPU time at its price."""
    assert intervals
    for iv in intervals:
        assert iv.capacity_us == iv.seconds * iv.gpus * 1_000_000, iv
        assert iv.attributed_us + iv.idle_us == iv.capacity_us, iv
        assert iv.capacity_cost == (Decimal(iv.capacity_us) * iv.gpu_hourly_cost
                                    / 3_600_000_000).quantize(PLACES), iv
        shares = UsageCostShare.objects.filter(interval=iv).aggregate(
            us=Sum("gpu_us"), cost=Sum("cost"))
        assert (shares["us"] or 0) == iv.attributed_us, iv
        assert (shares["cost"] or Decimal(0)) + iv.idle_cost == iv.capacity_cost, iv


def assert_rollups_hold_the_shares(org_id: int) -> None:
    """The rollups' GPU-seconds and cost-to-serve are the sums of their events' shares."""
    shares = UsageCostShare.objects.filter(organization_id=org_id).aggregate(
        us=Sum("gpu_us"), cost=Sum("cost"))
    rollups = UsageRollupHourly.objects.filter(organization_id=org_id).aggregate(
        gpu=Sum("gpu_seconds"), cost=Sum("cost_to_serve"))
    assert rollups["gpu"] == Decimal(shares["us"]).scaleb(-6)
    assert rollups["cost"] == shares["cost"]


def test_engine_gpu_time_goes_to_requests_and_idle_exactly_and_a_rerun_changes_nothing(
        transactional_db, tmp_path, settings, metering_stream, sims, celery_worker_process):
    settings.METERING_COST_INTERVAL_S = 1
    with engine_stack(tmp_path, metering_stream, model=MODEL, engines={
            "small-a": (sims["small-a"], 2, "3.60"), "small-b": (sims["small-b"], 1, "2.00"),
            "spare": (sims["spare"], 1, "2.00")}) as stack:
        # given engines scraped before and after two waves of concurrent requests of 1-2 s
        started = scrape()
        ids = stack.chat_at_once([120, 150, 180, 120])
        scrape()
        ids += stack.chat_at_once([200, 110, 130])
        ended = scrape()
        drain_usage()
        events = list(UsageEvent.objects.filter(request_id__in=ids))
        assert len(events) == len(ids) and all(e.status == "ok" for e in events)

        # when the beat's attribution task runs in a real worker
        celery_worker_process(queues="metering", beat=True, env={
            **metering_stream, "TOLLGATE_COST_INTERVAL_S": "1", "TOLLGATE_COST_SETTLE_S": "0",
            "TOLLGATE_COST_LOOKBACK_S": "900", "TOLLGATE_COST_ATTRIBUTE_EVERY_S": "1"})
        last_end = max(e.event_time + timedelta(milliseconds=e.total_ms) for e in events)
        wait_until(lambda: UsageCostInterval.objects.filter(
            start__gte=last_end.replace(microsecond=0)).exists() and set(usage_event_costs(
                event_ids=[e.id for e in events])) == {e.id for e in events},
            timeout=90, what="the attribution task to split the intervals of every request")

    # then every engine-interval from the first scrape to the last is conserved, busy or idle
    intervals = list(UsageCostInterval.objects.filter(
        start__gte=started.replace(microsecond=0) - timedelta(seconds=1), start__lt=ended))
    assert_conserved(intervals)
    by_engine = defaultdict(list)
    for iv in intervals:
        by_engine[iv.engine].append(iv)
    pools = {p.pool: p for p in usage_pool_capacity(start=started - timedelta(seconds=2),
                                                   end=ended + timedelta(seconds=2))}
    assert {iv.gpus for iv in by_engine["small-a-0"]} == {2}
    seconds = {iv.start for iv in by_engine["small-a-0"]}
    assert len(seconds) >= (ended - started).total_seconds() - 1  # every second it was up
    # an engine that was up and served nothing: all of its GPU time is idle capacity
    spare = by_engine["spare-0"]
    assert len(spare) >= (ended - started).total_seconds() - 1
    assert all(iv.idle_us == iv.capacity_us and iv.idle_cost == iv.capacity_cost
               for iv in spare)
    assert pools["spare"].idle_cost == pools["spare"].capacity_cost > 0
    # weighed by the engine's own measured throughput, not a default
    busy = [iv for iv in intervals if iv.attributed_us]
    assert busy and all(iv.throughput_source == ThroughputSource.MEASURED for iv in busy)
    assert all(Decimal(80) <= iv.decode_tokens_per_s <= Decimal(105) for iv in busy)
    # each request got a share of each interval it ran in: several, at 1-2 s per request
    spans = UsageCostShare.objects.filter(event_id__in=[e.id for e in events]).values(
        "event_id").annotate(n=Count("id"))
    assert all(row["n"] >= 2 for row in spans)
    # an event's GPU-seconds are its shares' sum; the rollups carry the events' shares
    costs_by_event = usage_event_costs(event_ids=[e.id for e in events])
    assert all(c.gpu_seconds > 0 and c.cost > 0 for c in costs_by_event.values())
    assert_rollups_hold_the_shares(events[0].organization_id)
    for pool in pools.values():
        assert pool.attributed_gpu_seconds + pool.idle_gpu_seconds == pool.capacity_gpu_seconds
        assert pool.attributed_cost + pool.idle_cost == pool.capacity_cost

    # when it runs again over the same intervals (as beats piling up would), nothing changes
    snapshot = sorted(UsageCostShare.objects.values_list("interval_id", "event_id", "gpu_us",
                                                         "cost"))
    again = costs.usage_costs_attribute(start=started - timedelta(seconds=2),
                                        end=ended + timedelta(seconds=1))
    assert again.attributed == 0 and again.unchanged >= len(intervals)
    assert sorted(UsageCostShare.objects.values_list("interval_id", "event_id", "gpu_us",
                                                     "cost")) == snapshot
    assert_rollups_hold_the_shares(events[0].organization_id)

    # when a late event lands in intervals already split, they are split again, still exact
    late_at = events[0].event_time
    record_events([UsageEventData(
        request_id=new_request_id(), org_id=events[0].organization_id,
        project_id=events[0].project_id, api_key_id=events[0].api_key_id, model=MODEL,
        region="us-east", data_zone=events[0].data_zone, engine=events[0].engine,
        event_time=late_at, prompt_tokens=300, completion_tokens=90, total_ms=900)],
        origin="spool")
    redo = costs.usage_costs_attribute(start=started - timedelta(seconds=2),
                                       end=ended + timedelta(seconds=1))
    assert redo.attributed >= 1
    assert_conserved(UsageCostInterval.objects.filter(engine=events[0].engine,
                                                      start__gte=started - timedelta(seconds=2)))
    assert_rollups_hold_the_shares(events[0].organization_id)


def test_a_request_with_twice_the_decode_tokens_gets_about_twice_the_gpu_seconds(
        transactional_db, tmp_path, settings, metering_stream):
    settings.METERING_COST_INTERVAL_S = 1
    sim = start_sim(served_model_name=MODEL, prefill_tokens_per_s=50_000,
                    decode_tokens_per_s=200)
    try:
        with engine_stack(tmp_path, metering_stream, model=MODEL,
                          engines={"solo": (sim, 1, "2.00")}) as stack:
            # given two requests alone on one engine, one after the other, the same prompt
            # size, one with twice the other's output tokens
            started = scrape()
            prompt = "Summarise the usage of the quarter in one line."
            short = stack.chat(tokens=100, prompt=prompt + " A")
            long = stack.chat(tokens=200, prompt=prompt + " B")
            ended = scrape()
            drain_usage()
    finally:
        sim.stop()
    events = {e.request_id: e for e in UsageEvent.objects.all()}
    assert events[short].completion_tokens * 2 == events[long].completion_tokens

    # when the intervals they ran in are attributed
    costs.usage_costs_attribute(start=started - timedelta(seconds=1),
                                end=ended + timedelta(seconds=1), now=timezone.now())

    # then the longer one got about twice the GPU-seconds
    got = usage_event_costs(event_ids=[events[short].id, events[long].id])
    ratio = got[events[long].id].gpu_seconds / got[events[short].id].gpu_seconds
    assert Decimal("1.7") < ratio < Decimal("2.3"), ratio
    assert_conserved(UsageCostInterval.objects.filter(engine="solo-0"))
