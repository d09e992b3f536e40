"""Reconciliation, engine against gateway, on simulated engines behind the live gateway.

The engines' own counters (scraped by the fleet's health check) are set against the usage the
platform metered from them, per engine and hour. Normal traffic, interactive and batch, is
captured exactly; an event lost on its way (taken off the usage stream before ingest) shows
as drift on its engine-hour alone, alerted once (audit row, ``/metrics``); an engine restarting
in the middle of the hour is not drift.
"""

from __future__ import annotations

import json
from datetime import timedelta
from decimal import Decimal

import httpx
import pytest
from django.utils import timezone

from billing_platform.audit.models import AuditEvent
from billing_platform.gateway.batch import runner
from billing_platform.gateway.batch import services as batch_services
from billing_platform.gateway.models import Batch
from engine_adapter.models import EngineCounterSample
from engine_adapter.sim.testing import start_sim
from metering import stream
from metering.choices import ReconcileStatus
from metering.events import EXTERNAL_PREFIX, UsageEventData
from metering.models import UsageEngineHour, UsageEvent
from metering.reconciliation import usage_engine_hours_reconcile
from metering.recording import record_events
from tests.gateway.conftest import drain_usage
from tests.gateway.test_batch_api import batch_env, request_line, upload
from tests.metering.engine_stack import engine_stack, scrape

MODEL = "small"
RATES = {"prefill_tokens_per_s": 100_000, "decode_tokens_per_s": 2_000}


def _hour(when):
    return when.replace(minute=0, second=0, microsecond=0)


def _closed(when):
    """An instant at which the hour of ``when`` is closed (ended and settled)."""
    return _hour(when) + timedelta(hours=1, minutes=30)


@pytest.fixture
def two_sims():
    sims = [start_sim(served_model_name=MODEL, **RATES) for _ in range(2)]
    yield sims
    for sim in sims:
        sim.stop()


def test_normal_traffic_and_batches_are_captured_exactly_on_every_engine_hour(
        transactional_db, tmp_path, settings, metering_stream, two_sims):
    env = batch_env(settings, tmp_path, metering_stream)
    with engine_stack(tmp_path, env, model=MODEL, engines={
            "small-0": (two_sims[0], 1, "2.00"), "small-1": (two_sims[1], 1, "2.00")}
            ) as stack:
        # given interactive requests and a batch on two engines, scraped around them
        started = scrape()
        stack.chat_at_once([20, 40, 60, 80, 30, 50])
        client = stack.client()
        created = client.batches.create(
            input_file_id=upload(client, [request_line(i, max_tokens=16) for i in range(8)]),
            endpoint="/v1/chat/completions", completion_window="24h")
        batch = batch_services.batch_validate(
            batch_id=Batch.objects.get(public_id=created.id).pk)
        assert runner.batch_run(batch_id=batch.pk, slice_s=60) == "drained"
        stack.chat(tokens=10, stream=True)
        scrape()
        drain_usage()
    # and an event an outside engine's operator reported through the usage API
    org = UsageEvent.objects.first().organization
    record_events([UsageEventData(
        request_id=f"{EXTERNAL_PREFIX}partner-1", org_id=org.id,
        project_id=UsageEvent.objects.first().project_id, model=MODEL, region="",
        engine="partner-gpu-7", event_time=timezone.now(), prompt_tokens=50,
        completion_tokens=5, source="external")], origin="api")

    # when the hours are reconciled
    usage_engine_hours_reconcile(start=started, now=timezone.now())

    # then every fleet engine-hour captured exactly what its engine counted
    fleet = list(UsageEngineHour.objects.exclude(engine="partner-gpu-7"))
    served = set(UsageEvent.objects.exclude(engine="partner-gpu-7").values_list("engine",
                                                                             flat=True))
    assert served <= {"small-0-0", "small-1-0"}
    assert {row.engine for row in fleet} == served
    for row in fleet:
        assert row.status == ReconcileStatus.RECONCILED, row.reason
        assert row.capture_rate == row.token_capture_rate == Decimal(1)
        assert row.engine_requests == row.metered_requests > 0
        assert (row.engine_prompt_tokens, row.engine_cached_tokens,
                row.engine_generation_tokens) == (
            row.metered_prompt_tokens, row.metered_cached_tokens,
            row.metered_completion_tokens)
        assert row.unverified_requests == 0
    metered = UsageEvent.objects.exclude(engine="partner-gpu-7")
    assert sum(row.metered_requests for row in fleet) == metered.count() == 15
    # the batch's lines went to the same engines and are counted like any request
    assert sum(row.metered_batch_requests for row in fleet) == 8
    # the outside engine reports no counters: its hour is marked, not judged
    outside = UsageEngineHour.objects.get(engine="partner-gpu-7")
    assert outside.status == ReconcileStatus.NOT_RECONCILABLE
    assert outside.metered_requests == 1 and outside.engine_requests is None


def test_an_event_lost_before_ingest_is_flagged_on_exactly_its_engine_hour(
        transactional_db, tmp_path, settings, metering_stream, two_sims):
    settings.METERING_RECONCILE_BOUNDARY_S = 0.02
    with engine_stack(tmp_path, metering_stream, model=MODEL, engines={
            "small-0": (two_sims[0], 1, "2.00"), "small-1": (two_sims[1], 1, "2.00")}
            ) as stack:
        # given sequential requests between two scrapes, spread over both engines
        scrape()
        ids = [stack.chat(tokens=100 + 10 * i) for i in range(10)]
        scrape()
        # when one of them (in the middle) is taken off the usage stream before it is ingested
        r = stream.client()
        entries = r.xrange(settings.METERING_STREAM_KEY)
        rows = [json.loads(fields[stream.FIELD]) for _, fields in entries]
        lost = next(i for i, row in enumerate(rows) if row[2] == ids[5])
        engine = rows[lost][8]
        r.xdel(settings.METERING_STREAM_KEY, entries[lost][0])
        drain_usage()
        assert UsageEvent.objects.count() == 9
        metrics_url = f"{stack.gateway.url}/metrics"

        # and the engine-hours are reconciled once the hour closed (twice: beats pile up)
        samples = list(EngineCounterSample.objects.filter(engine_id=engine).order_by("at"))
        usage_engine_hours_reconcile(start=samples[0].at, now=_closed(samples[-1].at))
        usage_engine_hours_reconcile(start=samples[0].at, now=_closed(samples[-1].at))

        # then exactly that engine-hour is in drift, short of one request
        drift = list(UsageEngineHour.objects.filter(status=ReconcileStatus.DRIFT))
        assert [(row.engine, row.hour) for row in drift] == [(engine, _hour(samples[-1].at))]
        row = drift[0]
        assert row.engine_requests == row.metered_requests + 1 and row.closed
        assert row.capture_rate == (Decimal(row.metered_requests)
                                    / Decimal(row.engine_requests)).quantize(Decimal("0.000001"))
        others = UsageEngineHour.objects.exclude(pk=row.pk)
        assert all(o.status == ReconcileStatus.RECONCILED for o in others)
        # audited once, naming the engine and the hour
        audits = list(AuditEvent.objects.filter(action="usage.engine_drift"))
        label = f"{engine} {row.hour:%Y-%m-%dT%H}:00Z"
        assert [a.target for a in audits] == [label]
        assert audits[0].after["metered_requests"] == row.metered_requests
        # and on /metrics, where the alert rule reads it
        text = httpx.get(metrics_url, timeout=10).text
        assert (f'tollgate_engine_reconcile_drift{{engine="{engine}",'
                f'hour="{row.hour:%Y-%m-%dT%H}:00Z"}} 1.0') in text


def test_an_engine_restart_mid_hour_is_not_drift(
        transactional_db, tmp_path, settings, metering_stream):
    sim = start_sim(served_model_name=MODEL, **RATES)
    try:
        with engine_stack(tmp_path, metering_stream, model=MODEL,
                          engines={"solo": (sim, 1, "2.00")}) as stack:
            # given traffic, a scrape, more traffic the old process takes with it...
            scrape()
            for n in (20, 30, 40):
                stack.chat(tokens=n)
            scrape()
            for n in (25, 35):
                stack.chat(tokens=n)
            # ...when the engine restarts (a new process on the same address, counters at 0)
            port = sim.port
            sim.stop()
            sim = start_sim(served_model_name=MODEL, port=port, **RATES)
            scrape()
            for n in (15, 45, 55, 65):
                stack.chat(tokens=n)
            scrape()
            drain_usage()
    finally:
        sim.stop()
    samples = list(EngineCounterSample.objects.order_by("at"))
    assert [s.epoch for s in samples] == [1, 1, 2, 2]

    # when the hour is reconciled
    usage_engine_hours_reconcile(start=samples[0].at, now=_closed(samples[-1].at))

    # then nothing drifted: what both process lives counted was metered, and the two requests
    # the old process took with it are shown as unverified, not as missing
    rows = list(UsageEngineHour.objects.all())
    assert rows and all(r.status == ReconcileStatus.RECONCILED for r in rows), [
        r.reason for r in rows]
    assert sum(r.engine_requests for r in rows) == sum(r.metered_requests for r in rows)
    assert sum(r.metered_requests for r in rows) == 3 + 4
    assert sum(r.unverified_requests for r in rows) == 2
    assert not AuditEvent.objects.filter(action="usage.engine_drift").exists()
