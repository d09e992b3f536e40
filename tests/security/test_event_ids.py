"""Hostile tenants cannot pre-claim the request ids of their own metered traffic.

Each source of usage has its own id space: the platform's request ids (a /v1 request's
``x-request-id``, a batch line's ``request_id``) are random ``req_...`` ids it issues itself,
and ids reported through ``POST /api/v1/usage/events`` are the caller's own namespace. A tenant
that reports zero-token events under the platform's ids (guessed ahead of a batch, or read off
a stream's headers before its usage lands) is refused and the attempt is kept where an
operator sees it; the real usage is recorded and billed in full.

Everything runs through the real surfaces: the official ``openai`` SDK against a live gateway
on simulated engines, a real Celery worker running the batch, and the usage API over DRF.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal

import openai
import pytest
from django.db.models import Sum

from billing_platform.gateway.models import BatchLine
from engine_adapter.sim.testing import FAST_RATES, SimProcess, start_sim
from metering.models import UsageEvent, UsageIdConflict, UsageRollupHourly
from tests.conftest import wait_until
from tests.factories import OrganizationFactory, ProjectFactory, make_key, make_price_book
from tests.gateway.conftest import (
    LiveGateway,
    drain_usage,
    register_engine,
    start_gateway,
    stop_gateway,
)

MODEL = "small"
SLOW = "slow"  # 40 tokens/s: a stream stays open long enough to read its headers first
USAGE_EVENTS = "/api/v1/usage/events"
PLATFORM_ID = re.compile(r"req_[0-9a-f]{32}")


@dataclass
class Tenant:
    """One organization: an inference + batch key for /v1, an admin key for the usage API."""

    org: object
    client: openai.OpenAI
    admin_secret: str
    admin_key_id: str


@dataclass
class Stack:
    gateway: LiveGateway
    sims: list[SimProcess]
    env: dict[str, str]

    def tenant(self) -> Tenant:
        project = ProjectFactory(organization=OrganizationFactory())
        _key, secret = make_key(project=project, scopes=["inference", "batch"])
        admin, admin_secret = make_key(project=project, scopes=["admin"])
        client = openai.OpenAI(base_url=f"{self.gateway.url}/v1", api_key=secret,
                               max_retries=0)
        return Tenant(project.organization, client, admin_secret, admin.public_id)


@pytest.fixture
def stack(transactional_db, tmp_path, settings, metering_stream) -> Iterator[Stack]:
    """A live gateway in front of a fast simulated engine (``small``) and a slow one."""
    settings.FILES_DIR = str(tmp_path / "files")
    settings.BATCH_HOST_CPU_CEILING = 1.0  # the host's load is not what this test is about
    env = {**metering_stream, "TOLLGATE_FILES_DIR": settings.FILES_DIR,
           "TOLLGATE_BATCH_SWEEP_S": "0.5", "TOLLGATE_BATCH_LEASE_S": "3",
           "TOLLGATE_FLEET_HEALTH_S": "3600", "TOLLGATE_BATCH_HOST_CPU_CEILING": "1.0"}
    make_price_book(prices=[{"model": m, "input": "0.50", "output": "1.50"}
                            for m in (MODEL, SLOW)])
    sims = [start_sim(served_model_name=MODEL, **FAST_RATES),
            start_sim(served_model_name=SLOW, decode_tokens_per_s=40)]
    for sim in sims:
        register_engine(sim, pool=f"{sim.model}-us", region="us-east", zone="us")
    gateway = start_gateway(tmp_path, env=env)
    yield Stack(gateway, sims, env)
    stop_gateway(gateway)
    for sim in sims:
        sim.stop()


def report_usage(api_client, tenant: Tenant, ids: list[str], **fields) -> dict:
    """Report zero-token events under ``ids`` through the usage API, as the tenant's admin."""
    body = {"events": [{"id": event_id, "model": MODEL, "prompt_tokens": 0,
                        "completion_tokens": 0, **fields} for event_id in ids]}
    reply = api_client.post(USAGE_EVENTS, body, format="json",
                            HTTP_AUTHORIZATION=f"Bearer {tenant.admin_secret}")
    assert reply.status_code == 200, reply.content
    return reply.json()


def platform_events(org, **filters) -> list[UsageEvent]:
    return list(UsageEvent.objects.filter(organization=org, source="gateway", **filters))


def billed(org) -> Decimal:
    return (UsageRollupHourly.objects.filter(organization=org)
            .aggregate(a=Sum("amount"))["a"] or Decimal(0))


def test_pre_claimed_stream_id_keeps_the_gateway_event(stack, api_client):
    # given a tenant streaming a completion from a slow engine
    tenant = stack.tenant()
    with tenant.client.chat.completions.with_streaming_response.create(
            model=SLOW, messages=[{"role": "user", "content": "Count to forty."}],
            max_tokens=40, stream=True, stream_options={"include_usage": True}) as response:
        request_id = response.headers["x-request-id"]
        # when, before the stream is over (nothing of it is metered yet), the tenant reports
        # a zero-token event under the stream's request id
        assert not platform_events(tenant.org)
        attack = report_usage(api_client, tenant, [request_id])
        again = report_usage(api_client, tenant, [request_id])  # and retries it
        chunks = list(response.parse())

    # then the attack is refused, both times, and nothing of it is recorded
    for reply in (attack, again):
        assert reply["recorded"] == 0 and reply["duplicates"] == 0 and reply["rejected"] == 1
        assert reply["errors"][0]["id"] == request_id
        assert reply["errors"][0]["code"] == "id_conflict"
    # and the gateway's event is recorded with the engine's real tokens, and billed
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 40

    def recorded():
        drain_usage()
        return platform_events(tenant.org, request_id=request_id)

    [event] = wait_until(recorded, timeout=15, what="the stream's usage event")
    assert (event.prompt_tokens, event.completion_tokens) == (usage.prompt_tokens, 40)
    assert event.amount > 0 and billed(tenant.org) == event.amount
    assert UsageEvent.objects.filter(organization=tenant.org).count() == 1
    # and the attempt is where an operator looks: a conflict row and a metric
    conflict = UsageIdConflict.objects.get(organization=tenant.org)
    assert (conflict.request_id, conflict.source, conflict.attempts) == (
        request_id, "external", 2)
    assert conflict.reported_by == tenant.admin_key_id
    assert conflict.payload["prompt_tokens"] == 0
    metrics = api_client.get("/metrics").content.decode()
    assert re.search(r'tollgate_usage_id_conflicts_total\{source="external"\} [1-9]', metrics)


def _batch_file(client: openai.OpenAI, lines: int) -> str:
    raw = b"".join(json.dumps({
        "custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": MODEL, "max_tokens": 6,
                 "messages": [{"role": "user", "content": f"Summarise item {i}."}]},
    }).encode() + b"\n" for i in range(lines))
    return client.files.create(file=("batch.jsonl", io.BytesIO(raw)), purpose="batch").id


def test_pre_claimed_batch_line_ids_do_not_unbill_the_batch(stack, api_client,
                                                            celery_worker_process):
    # given a tenant's batch of 12 lines, created while no worker has picked it up yet
    tenant = stack.tenant()
    lines = 12
    batch = tenant.client.batches.create(input_file_id=_batch_file(tenant.client, lines),
                                         endpoint="/v1/chat/completions",
                                         completion_window="24h")
    assert batch.status == "validating"

    # when the tenant reports zero-token usage under every id its lines could be given
    # (the batch id and the line number, as they once were)
    guesses = [f"{batch.id}-{n}" for n in range(lines + 2)]
    report_usage(api_client, tenant, guesses, batch_id=batch.id)
    # and the batch runs under a real worker
    celery_worker_process(queues="batch", beat=True, env=stack.env)

    def finished():
        b = tenant.client.batches.retrieve(batch.id)
        return b if b.status in ("completed", "failed", "expired", "cancelled") else None

    done = wait_until(finished, timeout=120, what=f"batch {batch.id} to finish")
    assert done.status == "completed" and done.request_counts.completed == lines, done

    # then each line was metered under a random id of its own, with the engine's tokens
    line_ids = list(BatchLine.objects.filter(batch__public_id=batch.id)
                    .values_list("request_id", flat=True))
    assert len(set(line_ids)) == lines
    assert all(PLATFORM_ID.fullmatch(rid) for rid in line_ids), line_ids

    def metered():
        drain_usage()
        found = platform_events(tenant.org, batch_id=batch.id)
        return found if len(found) == lines else None

    found = wait_until(metered, timeout=30, what="the batch's usage events")
    assert {e.request_id for e in found} == set(line_ids)
    assert all(e.prompt_tokens > 0 and e.completion_tokens == 6 and e.amount > 0
               for e in found)
    # and the whole batch is billed: the rollups hold its real amount (the guesses add 0)
    assert billed(tenant.org) == sum(e.amount for e in found) > 0

    # when the tenant, having read the line ids off the output file, reports them as its own
    output = tenant.client.files.content(done.output_file_id).text.splitlines()
    read_ids = [json.loads(row)["response"]["request_id"] for row in output]
    assert sorted(read_ids) == sorted(line_ids)
    reply = report_usage(api_client, tenant, read_ids[:3])

    # then it is refused and recorded as a conflict; the metered events stay as they were
    assert reply["recorded"] == 0 and {e["code"] for e in reply["errors"]} == {"id_conflict"}
    assert set(UsageIdConflict.objects.filter(organization=tenant.org)
               .values_list("request_id", flat=True)) == set(read_ids[:3])
    assert UsageEvent.objects.get(request_id=read_ids[0]).completion_tokens == 6
    assert billed(tenant.org) == sum(e.amount for e in found)


def test_external_ids_are_the_callers_own_and_retries_are_duplicates(stack, api_client):
    # given a tenant that reports usage of an engine of its own, under ids of its own, some
    # of which look like the platform's but are not of its form
    tenant = stack.tenant()
    ids = ["evt-1", "req_123", "ext:evt-1"]

    # when it reports them, then retries the call
    first = report_usage(api_client, tenant, ids, prompt_tokens=100, completion_tokens=10)
    retry = report_usage(api_client, tenant, ids, prompt_tokens=100, completion_tokens=10)

    # then the first call records each one, the retry is told they were already recorded,
    # and the caller sees its own ids back
    assert [(d["id"], d["status"]) for d in first["data"]] == [(i, "recorded") for i in ids]
    assert [(d["id"], d["status"]) for d in retry["data"]] == [(i, "duplicate") for i in ids]
    assert first["errors"] == retry["errors"] == []
    assert UsageEvent.objects.filter(organization=tenant.org, source="external").count() == 3
    assert not UsageIdConflict.objects.exists()
    # and a request through the gateway never shares an id with them
    raw = tenant.client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert PLATFORM_ID.fullmatch(raw.headers["x-request-id"])
