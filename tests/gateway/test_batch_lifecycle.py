"""Expiry and cancellation: the right statuses, counts and files, and usage equal to the
completed lines only. The runner is driven in this process one slice at a time (so the point
where the batch stops is exact); the cancel-under-a-worker test uses a real Celery worker.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from decimal import Decimal

import openai
import pytest
from django.utils import timezone

from billing_platform.accounts.selectors import KeyPrincipal
from billing_platform.gateway.batch import runner
from billing_platform.gateway.batch import services as batch_services
from billing_platform.gateway.models import Batch, BatchLine
from engine_adapter.registry import Fleet
from engine_adapter.sim.testing import start_sim
from tests.conftest import wait_until
from tests.gateway.conftest import stop_gateway
from tests.gateway.test_batch_api import (
    MODEL,
    batch_env,
    batch_events,
    fast_stack,
    request_line,
    results,
    start_stack,
    upload,
    wait_status,
)


@pytest.fixture
def stack(transactional_db, tmp_path, settings, metering_stream):
    yield from fast_stack(tmp_path, settings, metering_stream)


def _started_batch(stack, settings, lines: int = 10):
    """Create a batch through the SDK and validate it here; return (client, batch row)."""
    client = stack.client()
    created = client.batches.create(
        input_file_id=upload(client, [request_line(i) for i in range(lines)]),
        endpoint="/v1/chat/completions", completion_window="24h")
    batch = batch_services.batch_validate(batch_id=Batch.objects.get(public_id=created.id).pk)
    assert batch.status == "in_progress" and batch.total == lines
    return client, batch


def _run_lines(settings, batch: Batch, n: int) -> None:
    """Run exactly ``n`` lines: one runner iteration with a chunk of ``n``."""
    settings.BATCH_CHUNK = n
    assert runner.batch_run(batch_id=batch.pk, slice_s=0.001) == "slice"
    assert BatchLine.objects.filter(batch=batch, state="completed").count() == n


def _run_held(batch: Batch, token: str, lines: list[BatchLine]) -> int:
    """Finish lines this test leased, as the worker holding them would; return recorded."""
    async def go():
        fleet = Fleet()
        await asyncio.to_thread(fleet.refresh)
        try:
            return await asyncio.gather(*(runner._run_line(
                line, fleet=fleet, batch=batch, principal=KeyPrincipal.from_json(
                    batch.principal), regions=None) for line in lines))
        finally:
            await fleet.client.aclose()

    outcomes = asyncio.run(go())
    return batch_services.batch_lines_record(batch_id=batch.pk, token=token,
                                             outcomes=list(outcomes))


def test_expiry_keeps_finished_lines_and_bills_only_them(stack, settings):
    # given 4 of 10 lines done and 2 more in flight
    client, batch = _started_batch(stack, settings)
    _run_lines(settings, batch, 4)
    token, held = batch_services.batch_lines_claim(batch_id=batch.pk, limit=2)

    # when the completion window passes
    Batch.objects.filter(pk=batch.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    report = batch_services.batch_sweep()

    # then the batch is expired with the finished lines in the output and the rest as errors
    assert report["expired"] == 1
    expired = client.batches.retrieve(batch.public_id)
    assert expired.status == "expired" and expired.expired_at and expired.finalizing_at
    assert (expired.request_counts.total, expired.request_counts.completed,
            expired.request_counts.failed) == (10, 4, 0)
    output = results(client, expired.output_file_id)
    errors = results(client, expired.error_file_id)
    assert sorted(r["custom_id"] for r in output) == [f"req-{i}" for i in range(4)]
    assert sorted(r["custom_id"] for r in errors) == sorted(f"req-{i}" for i in range(4, 10))
    assert {r["error"]["code"] for r in errors} == {"batch_expired"}
    assert all(r["response"] is None for r in errors)
    # the in-flight lines finish after the expiry: dropped, never billed
    assert _run_held(batch, token, held) == 0
    assert len(batch_events(batch.public_id, 4)) == 4


def test_cancel_keeps_finished_and_in_flight_lines_and_drops_the_rest(stack, settings):
    # given 4 of 10 lines done and 2 in flight
    client, batch = _started_batch(stack, settings)
    _run_lines(settings, batch, 4)
    token, held = batch_services.batch_lines_claim(batch_id=batch.pk, limit=2)

    # when the caller cancels
    cancelling = client.batches.cancel(batch.public_id)

    # then it is cancelling until the lines in flight finish, and those are kept
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    assert batch_services.batch_lines_claim(batch_id=batch.pk, limit=10)[1] == []
    assert _run_held(batch, token, held) == 2
    assert batch_services.batch_finalize_if_done(batch_id=batch.pk)
    cancelled = client.batches.retrieve(batch.public_id)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at
    assert (cancelled.request_counts.total, cancelled.request_counts.completed,
            cancelled.request_counts.failed) == (10, 6, 0)
    assert sorted(r["custom_id"] for r in results(client, cancelled.output_file_id)) == [
        f"req-{i}" for i in range(6)]
    errors = results(client, cancelled.error_file_id)
    assert sorted(r["custom_id"] for r in errors) == sorted(f"req-{i}" for i in range(6, 10))
    assert {r["error"]["code"] for r in errors} == {"batch_cancelled"}
    events = batch_events(batch.public_id, 6)
    assert sorted(e.request_id for e in events) == sorted(BatchLine.objects.filter(
        batch=batch, line_no__lte=6).values_list("request_id", flat=True))
    # cancelling again is harmless; a finished batch cannot be cancelled into another state
    assert client.batches.cancel(batch.public_id).status == "cancelled"


def test_lines_handed_back_run_again_or_end_cancelled_if_the_batch_was_cancelled(
        stack, settings):
    from billing_platform.gateway.batch.services import LineOutcome

    # given a worker holding 4 lines: 2 it tried (the engine failed) and 2 it never sent
    client, batch = _started_batch(stack, settings)
    token, held = batch_services.batch_lines_claim(batch_id=batch.pk, limit=4)
    tried = [LineOutcome(line.id, retry=True) for line in held[:2]]
    unsent = [LineOutcome(line.id, retry=True, started=False) for line in held[2:]]

    # when it hands them back while the batch runs
    batch_services.batch_lines_record(batch_id=batch.pk, token=token, outcomes=tried + unsent)

    # then all four can be claimed again; only the tried ones used up an attempt
    lines = {line.id: line for line in BatchLine.objects.filter(id__in=[h.id for h in held])}
    assert {line.state for line in lines.values()} == {"pending"}
    assert [lines[h.id].attempts for h in held] == [1, 1, 0, 0]

    # when the same happens after the caller cancelled
    token, held = batch_services.batch_lines_claim(batch_id=batch.pk, limit=4)
    client.batches.cancel(batch.public_id)
    batch_services.batch_lines_record(batch_id=batch.pk, token=token, outcomes=[
        LineOutcome(line.id, retry=True, started=i < 2) for i, line in enumerate(held)])

    # then they end cancelled instead of pending (which held the cancel open until expiry)
    assert batch_services.batch_finalize_if_done(batch_id=batch.pk)
    cancelled = client.batches.retrieve(batch.public_id)
    assert cancelled.status == "cancelled"
    assert (cancelled.request_counts.completed, cancelled.request_counts.failed) == (0, 0)
    errors = results(client, cancelled.error_file_id)
    assert len(errors) == 10 and {r["error"]["code"] for r in errors} == {"batch_cancelled"}
    assert batch_events(batch.public_id, 0) == []


def test_lines_claimed_ahead_go_back_unstarted_when_a_slice_ends_and_run_once_later(
        stack, settings):
    # given a batch of 10 lines and a runner that leases them 4 at a time (it leases the next
    # 4 while the first run, so a finished line is replaced without a database round trip)
    client, batch = _started_batch(stack, settings)

    # when one slice ends after starting 4 lines
    _run_lines(settings, batch, 4)

    # then the other 6 are pending again, none charged an attempt it never made (a line is
    # failed after MAX_ATTEMPTS), and no lease is left behind
    rest = BatchLine.objects.filter(batch=batch).exclude(state="completed")
    assert sorted((line.state, line.attempts, line.lease_token) for line in rest) == [
        ("pending", 0, "")] * 6

    # and when the next slices run the batch out, every line ran and is billed once
    assert runner.batch_run(batch_id=batch.pk, slice_s=60) == "drained"
    done = client.batches.retrieve(batch.public_id)
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (10, 0)
    assert sorted(r["custom_id"] for r in results(client, done.output_file_id)) == sorted(
        f"req-{i}" for i in range(10))
    assert len(batch_events(batch.public_id, 10)) == 10


def test_cancel_under_a_worker_stops_within_a_minute(
        transactional_db, tmp_path, settings, metering_stream, celery_worker_process):
    # given a worker running a batch on slow engines, long enough that it cannot finish
    # between the moment some lines are seen done and the cancel (a line takes 160 ms; the
    # runner keeps every free slot filled: 400 lines of 40 ms ran out in under a second)
    n = 1000
    sims = [start_sim(served_model_name=MODEL, prefill_tokens_per_s=1_000_000,
                      decode_tokens_per_s=200)]
    stack_ = start_stack(tmp_path, batch_env(settings, tmp_path, metering_stream), sims)
    try:
        client = stack_.client()
        file_id = upload(client, [request_line(i, max_tokens=32) for i in range(n)])
        celery_worker_process(queues="batch", beat=True, env=stack_.env)
        batch = client.batches.create(input_file_id=file_id,
                                      endpoint="/v1/chat/completions", completion_window="24h")
        wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 20,
                   timeout=60, what="some lines done")

        # when it is cancelled
        client.batches.cancel(batch.id)
        done = wait_status(client, batch.id, ("cancelled",), timeout=60)

        # then finished lines are kept and billed, the rest are in the error file
        completed = done.request_counts.completed
        assert 20 <= completed < n
        assert len(results(client, done.output_file_id)) == completed
        assert len(results(client, done.error_file_id)) == n - completed
        assert len(batch_events(batch.id, completed)) == completed
    finally:
        stop_gateway(stack_.gateway)
        for sim in sims:
            sim.stop()


def test_hard_budget_stops_the_batch_and_bills_only_what_ran(stack, settings):
    from django.db.models import Sum

    from metering.models import UsageEvent
    from plans import quotas
    from tests.factories import OrganizationFactory, ProjectFactory, make_key

    # given a hard monthly budget worth a handful of batch lines
    org = OrganizationFactory()
    _key, secret = make_key(project=ProjectFactory(organization=org),
                            scopes=["inference", "batch"])
    budget = Decimal("0.00005")
    quotas.budget_set(organization=org, amount=budget, hard=True)
    client = openai.OpenAI(base_url=f"{stack.gateway.url}/v1", api_key=secret, max_retries=0)
    created = client.batches.create(
        input_file_id=upload(client, [request_line(i, max_tokens=4) for i in range(60)]),
        endpoint="/v1/chat/completions", completion_window="24h")
    batch = batch_services.batch_validate(batch_id=Batch.objects.get(public_id=created.id).pk)

    # when the runner works through it
    settings.BATCH_CHUNK = 8
    assert runner.batch_run(batch_id=batch.pk, slice_s=60) == "drained"

    # then it ended with the lines that ran, the rest failed with the spend limit, unbilled
    done = client.batches.retrieve(created.id)
    assert done.status == "completed"
    completed, failed = done.request_counts.completed, done.request_counts.failed
    assert 1 <= completed < 60 and completed + failed == 60
    errors = results(client, done.error_file_id)
    assert len(errors) == failed
    assert {r["error"]["code"] for r in errors} == {"organization_spend_limit_exceeded"}
    events = batch_events(created.id, completed)
    assert len(events) == completed
    spend = UsageEvent.objects.filter(organization=org).aggregate(s=Sum("amount"))["s"]
    assert spend <= budget
