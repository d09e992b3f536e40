"""Budgets end to end: alerts once per threshold (email from the sweep, HMAC-signed webhook from
a real worker to a real local HTTP server), suspension of an exhausted hard budget's keys and
reinstatement when it is raised, drift repair of Redis from PostgreSQL, and the audit log.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from billing_platform.audit.models import AuditEvent
from metering.models import UsageEvent
from plans import admission, quotas, webhooks
from plans.models import BudgetAlert
from tests.conftest import wait_until
from tests.factories import OrganizationFactory, ProjectFactory, make_key
from tests.gateway.conftest import drain_usage, live_gateway  # noqa: F401


@pytest.fixture
def webhook_sink():
    """A real HTTP server that records each POST (headers and raw body)."""
    received: list[tuple[dict[str, str], bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((dict(self.headers), body))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hooks/tollgate", received
    server.shutdown()


def _chat(gateway, secret: str) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {secret}"},
                      json={"model": "small", "max_tokens": 10,
                            "messages": [{"role": "user", "content": "hi"}]})


def test_alerts_fire_once_per_threshold_by_email_and_signed_webhook(
        live_gateway, webhook_sink, mailoutbox, celery_worker_process, settings):  # noqa: F811
    url, received = webhook_sink
    settings.WEBHOOK_ALLOW_PRIVATE_ADDRESSES = True  # the sink is on this host
    worker = celery_worker_process(queues="quota", env={
        "TOLLGATE_WEBHOOK_ALLOW_PRIVATE_ADDRESSES": "1"})
    org = OrganizationFactory()
    _key, secret = make_key(project=ProjectFactory(organization=org), scopes=["inference"])
    budget = quotas.budget_set(organization=org, amount="0.0002", hard=False,
                               alert_emails=["ops@example.com"], webhook_url=url)

    # when spend grows past 50, 80 and 100 % (the sweep runs after every request)
    for _ in range(40):
        assert _chat(live_gateway, secret).status_code == 200  # soft: never refused
        quotas.budget_sweep()
        if BudgetAlert.objects.filter(budget=budget, threshold=100).exists():
            break
    for _ in range(3):
        quotas.budget_sweep()  # sweeping again changes nothing

    # then each threshold fired exactly once, by email and by webhook
    assert sorted(BudgetAlert.objects.filter(budget=budget)
                  .values_list("threshold", flat=True)) == [50, 80, 100]
    assert len(mailoutbox) == 3
    assert all(m.to == ["ops@example.com"] for m in mailoutbox)
    wait_until(lambda: len(received) >= 3, timeout=120,
               what=f"three webhooks from the worker (log: {worker.log_path})")
    assert sorted(json.loads(body)["threshold"] for _h, body in received) == [50, 80, 100]
    for headers, body in received:
        header = headers["Tollgate-Signature"]
        # the documented scheme: t=<unix>,v1=hex(HMAC-SHA256(secret, "<t>." + raw body))
        parts = dict(p.split("=", 1) for p in header.split(","))
        expected = hmac.new(budget.webhook_secret.encode(), f"{parts['t']}.".encode() + body,
                            hashlib.sha256).hexdigest()
        assert hmac.compare_digest(parts["v1"], expected)
        assert webhooks.verify_webhook(secret=budget.webhook_secret, body=body, header=header)
        assert not webhooks.verify_webhook(secret=budget.webhook_secret, body=body + b" ",
                                           header=header)
    wait_until(lambda: BudgetAlert.objects.filter(
        budget=budget, webhook_status="204", webhook_delivered_at__isnull=False).count() == 3,
        timeout=30, what="the alerts to record their deliveries")
    assert len(received) == 3
    assert AuditEvent.objects.filter(organization=org, action="budget.alert").count() == 3


def test_an_exhausted_hard_project_budget_suspends_its_keys_and_raising_it_reinstates(
        live_gateway):  # noqa: F811
    org = OrganizationFactory()
    project = ProjectFactory(organization=org)
    _key, secret = make_key(project=project, scopes=["inference"])
    budget = quotas.budget_set(organization=org, project=project, amount="1.00", hard=True)
    ids = [_chat(live_gateway, secret).headers["x-request-id"] for _ in range(3)]

    def ingested():
        drain_usage()
        return UsageEvent.objects.filter(request_id__in=ids).count() == 3

    wait_until(ingested, timeout=10, what="events ingested")
    spent = quotas.budget_state(budget=budget).pg_spend
    assert spent > 0

    # given Redis lost part of the month's spend, the sweep restores it from PostgreSQL
    from billing_platform.redis_conn import get_redis

    key = admission.budget_key(org.id, budget.id, budget.created_at)
    get_redis().hset(key, "spent", 1)
    quotas.budget_sweep()
    assert admission.from_micro(get_redis().hget(key, "spent")) >= spent
    assert AuditEvent.objects.filter(organization=org,
                                          action="budget.drift_fixed").exists()

    # when the budget is lowered below this month's spend, the sweep suspends the keys
    quotas.budget_set(organization=org, project=project, amount=spent / 2, hard=True)
    quotas.budget_sweep()
    budget.refresh_from_db()
    assert budget.suspended_at is not None

    def refused():
        r = _chat(live_gateway, secret)
        return r if r.status_code == 429 else None

    r = wait_until(refused, timeout=10, what="the key to be refused")
    assert r.json()["error"]["code"] == "project_spend_limit_exceeded"
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert "retry-after" in r.headers

    # when the budget is raised, the keys are reinstated
    quotas.budget_set(organization=org, project=project, amount="1.00", hard=True)
    budget.refresh_from_db()
    assert budget.suspended_at is None
    wait_until(lambda: _chat(live_gateway, secret).status_code == 200, timeout=10,
               what="the key to be reinstated")
    actions = list(AuditEvent.objects.filter(organization=org)
                   .order_by("created_at").values_list("action", flat=True))
    assert actions.index("keys.suspended") < actions.index("keys.reinstated")
    assert Decimal(str(spent)) > 0


def test_the_beat_sweep_in_a_real_worker_alerts_and_suspends(
        celery_worker_process, metering_stream, mailoutbox):
    # given a hard budget already exceeded by usage recorded in PostgreSQL
    from datetime import UTC, datetime

    from metering.services import usage_event_append
    from tests.factories import make_price_book

    make_price_book(prices=[{"model": "small", "input": "0.50", "output": "1.50"}])
    org = OrganizationFactory()
    project = ProjectFactory(organization=org)
    key, _secret = make_key(project=project, scopes=["inference"])
    budget = quotas.budget_set(organization=org, amount="0.0001", hard=True)
    usage_event_append({
        "request_id": "req_beat_sweep_1", "org_id": org.id, "project_id": project.id,
        "api_key_id": key.id, "model": "small", "region": "us-east", "data_zone": "global",
        "engine": "e", "service_tier": "default", "capacity_source": "on_demand",
        "prompt_tokens": 1000, "cached_tokens": 0, "completion_tokens": 0,
        "status": "ok", "cost_to_serve": "0", "event_time": datetime.now(tz=UTC).isoformat()})
    drain_usage()

    # when the worker's beat runs the sweep (every second here)
    worker = celery_worker_process(queues="quota", beat=True,
                                   env={**metering_stream, "TOLLGATE_BUDGET_SWEEP_S": "1"})

    # then the budget's keys are suspended and every threshold fired once
    def swept():
        budget.refresh_from_db()
        return budget.suspended_at is not None and budget.alerts.count() == 3

    wait_until(swept, timeout=60, what=f"the sweep (worker log: {worker.log_path})")
    assert "plans.budget_sweep" in worker.log_path.read_text()
    assert sorted(budget.alerts.values_list("threshold", flat=True)) == [50, 80, 100]
