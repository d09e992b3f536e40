"""A running batch stops once its key, its organization or its data zone no longer allows it.

A real Celery worker runs the batch on a slow simulated engine; mid-batch the test revokes the
key, suspends the organization or moves it to a data zone where the model is not offered. The
batch ends ``failed`` with the reason in ``errors``; the lines that finished are in the output
file and metered once, every other line is in the error file with the same reason, and no
line was sent to the engine after the stop (the engine served exactly the completed lines).
"""

from __future__ import annotations

import httpx
import openai
import pytest

from billing_platform.accounts import services as accounts
from billing_platform.accounts.choices import DataZone, OrgStatus
from billing_platform.gateway.models import Batch, BatchLine
from engine_adapter.sim.testing import start_sim
from tests.conftest import wait_until
from tests.factories import OrganizationFactory, ProjectFactory, make_key
from tests.gateway.conftest import stop_gateway
from tests.gateway.test_batch_api import (
    MODEL,
    batch_env,
    batch_events,
    request_line,
    results,
    start_stack,
    upload,
)

LINES = 400


def _revoke(org, key) -> None:
    accounts.api_key_revoke(api_key=key)


def _suspend(org, key) -> None:
    accounts.organization_update(organization=org, status=OrgStatus.SUSPENDED)


def _move_to_eu(org, key) -> None:
    # the model's only engine is in us-east: the EU zone does not offer it
    accounts.organization_update(organization=org, data_zone=DataZone.EU)


def _undo(org) -> None:
    """Give the organization its standing back (the key stays revoked), so the test can read
    the batch through the SDK with another of its keys, as its owner would."""
    org.refresh_from_db()
    accounts.organization_update(organization=org, status=OrgStatus.ACTIVE,
                                 data_zone=DataZone.GLOBAL)


@pytest.mark.parametrize(("change", "code"), [
    (_revoke, "api_key_revoked"),
    (_suspend, "organization_suspended"),
    (_move_to_eu, "model_not_found"),
], ids=["key-revoked", "org-suspended", "zone-changed"])
def test_a_batch_stops_when_its_key_org_or_zone_no_longer_allows_it(
        change, code, transactional_db, tmp_path, settings, metering_stream,
        celery_worker_process):
    # given a worker running a batch of a global organization on a slow engine of four slots
    # (an idle fleet is batch's to fill: on more slots the batch would end before the change)
    sim = start_sim(served_model_name=MODEL, prefill_tokens_per_s=1_000_000,
                    decode_tokens_per_s=200, max_running_requests=4)
    stack = start_stack(tmp_path, batch_env(settings, tmp_path, metering_stream), [sim])
    try:
        org = OrganizationFactory()
        project = ProjectFactory(organization=org)
        key, secret = make_key(project=project, scopes=["inference", "batch"])
        _other, owner_secret = make_key(project=project, scopes=["batch"])
        client = openai.OpenAI(base_url=f"{stack.gateway.url}/v1", api_key=secret,
                               max_retries=0)
        file_id = upload(client, [request_line(i, max_tokens=8) for i in range(LINES)])
        celery_worker_process(queues="batch", beat=True, env=stack.env)
        created = client.batches.create(input_file_id=file_id,
                                        endpoint="/v1/chat/completions",
                                        completion_window="24h")
        wait_until(lambda: Batch.objects.get(public_id=created.id).completed >= 20,
                   timeout=60, what="some lines done")

        # when the key, the organization or its data zone stops allowing it
        change(org, key)

        # then the batch ends failed, saying why
        ended = wait_until(
            lambda: Batch.objects.filter(public_id=created.id).exclude(
                status__in=("in_progress", "finalizing")).first(),
            timeout=60, what="the batch to stop")
        assert ended.status == "failed", ended.status
        _undo(org)
        owner = openai.OpenAI(base_url=f"{stack.gateway.url}/v1", api_key=owner_secret,
                              max_retries=0)
        done = owner.batches.retrieve(created.id)
        assert done.status == "failed" and done.failed_at and done.finalizing_at
        assert [e.code for e in done.errors.data] == [code]
        assert "stopped" in done.errors.data[0].message
        completed, failed = done.request_counts.completed, done.request_counts.failed
        assert 20 <= completed < LINES and completed + failed == LINES

        # and the finished lines are kept and billed once; the rest were not run or billed
        output = results(owner, done.output_file_id)
        errors = results(owner, done.error_file_id)
        assert len(output) == completed and len(errors) == failed
        assert {r["error"]["code"] for r in errors} == {code}
        assert all(r["response"] is None for r in errors)
        events = batch_events(created.id, completed)
        assert sorted(e.request_id for e in events) == sorted(
            r["response"]["request_id"] for r in output)
        assert BatchLine.objects.filter(batch__public_id=created.id,
                                        metered=True).count() == completed
        # the engine served the completed lines and nothing else: none ran after the stop
        stats = httpx.get(f"{sim.base_url}/sim/stats", timeout=10).json()
        assert stats["requests"] == completed, stats
    finally:
        stop_gateway(stack.gateway)
        sim.stop()
