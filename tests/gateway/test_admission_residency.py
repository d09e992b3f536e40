"""Residency narrowed per project and key: requests run only in the allowed regions, fail
closed (503) when those engines are down, and the residency audit finds no event outside its
organization's zone."""

from __future__ import annotations

import httpx

from billing_platform.accounts.choices import DataZone
from engine_adapter.choices import EngineStatus
from engine_adapter.models import EngineInstance
from metering.models import UsageEvent
from plans import limits
from plans.selectors import usage_events_outside_zone
from tests.conftest import wait_until
from tests.factories import OrganizationFactory, ProjectFactory, make_key
from tests.gateway.conftest import drain_usage


def _chat(gateway, secret: str) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {secret}"},
                      json={"model": "small", "max_tokens": 3,
                            "messages": [{"role": "user", "content": "hi"}]})


def test_a_project_narrowed_to_eu_runs_only_there_and_fails_closed(live_gateway):
    # given a global organization whose project may only use eu-west
    org = OrganizationFactory(data_zone=DataZone.GLOBAL)
    project = ProjectFactory(organization=org)
    _key, secret = make_key(project=project, scopes=["inference"])
    limits.quota_limit_set(organization=org, project=project, allowed_regions=["eu-west"])

    # when it sends requests, they all run in eu-west
    responses = [_chat(live_gateway, secret) for _ in range(6)]
    assert {r.status_code for r in responses} == {200}
    assert {r.headers["x-tollgate-region"] for r in responses} == {"eu-west"}

    # when the EU engines are down, the answer is 503 and nothing runs in the US
    EngineInstance.objects.filter(pool__region="eu-west").update(status=EngineStatus.UNHEALTHY)
    us_before = httpx.get(f"{live_gateway.sims['us'].base_url}/sim/stats").json()["requests"]
    down = wait_until(lambda: (r := _chat(live_gateway, secret)).status_code == 503 and r,
                      timeout=5, what="the fleet view to refresh")
    assert down.json()["error"]["type"] == "server_error"
    assert httpx.get(f"{live_gateway.sims['us'].base_url}/sim/stats").json()["requests"] == (
        us_before)
    ids = [r.headers["x-request-id"] for r in responses]

    def ingested():
        drain_usage()
        return UsageEvent.objects.filter(request_id__in=ids).count() == len(ids)

    wait_until(ingested, timeout=10, what="events ingested")
    assert set(UsageEvent.objects.filter(organization=org).values_list("region", flat=True)) == {
        "eu-west"}


def test_a_key_narrowed_to_a_region_without_the_model_gets_404(live_gateway):
    org = OrganizationFactory(data_zone=DataZone.EU)
    project = ProjectFactory(organization=org)
    key, secret = make_key(project=project, scopes=["inference"])
    limits.quota_limit_set(organization=org, api_key=key, allowed_regions=["ap-south"])
    r = _chat(live_gateway, secret)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert not UsageEvent.objects.filter(organization=org).exists()


def test_the_residency_audit_lists_events_outside_their_zone(live_gateway):
    # given EU and US organizations whose requests ran in their zones
    eu = OrganizationFactory(data_zone=DataZone.EU)
    us = OrganizationFactory(data_zone=DataZone.US)
    ids = []
    for org in (eu, us):
        _k, secret = make_key(project=ProjectFactory(organization=org), scopes=["inference"])
        ids += [_chat(live_gateway, secret).headers["x-request-id"] for _ in range(2)]

    def ingested():
        drain_usage()
        return UsageEvent.objects.filter(request_id__in=ids).count() == len(ids)

    wait_until(ingested, timeout=10, what="events ingested")
    # then the audit finds none outside the zone ...
    assert usage_events_outside_zone() == []
    # ... and would name one if it existed
    UsageEvent.objects.filter(organization=eu).update(region="us-east")
    flagged = usage_events_outside_zone()
    assert {row["organization_id"] for row in flagged} == {eu.id}
    assert {row["region"] for row in flagged} == {"us-east"}
