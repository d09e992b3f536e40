"""Two ingest transactions rating overlapping batches at once never double count credits."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.db import connection, transaction

from plans import services
from plans.models import TokenPlanPeriod, TokenPlanUsage
from plans.rating import rate_usage_batch
from tests.factories import OrganizationFactory, make_price_book, make_token_plan
from tests.plans.helpers import usage

pytestmark = pytest.mark.django_db(transaction=True)
D = Decimal


def test_concurrent_overlapping_batches_count_each_event_once():
    """Plan: 600 credits per period, no window, overage. Events: 90 distinct, 10 credits each.

    Worker A rates events 0-59, worker B events 30-89, in two transactions that start
    together and stay open a moment (as metering's ingest does). Events 30-59 arrive twice.
    Unique demand: 90 x 10 = 900 credits -> exactly 600 in the plan and 300 overage, whatever
    the interleaving; the shared events get the same rating in both workers. Without the
    subscription lock both would see 0 used and give away 1,200 credits.
    """
    make_price_book(prices=[{"model": "test-model", "input": "1.00", "output": "2.00"}])
    org = OrganizationFactory()
    plan = make_token_plan(credits_per_period="600", window_credits=None)
    sub = services.subscription_create(organization=org, plan=plan,
                                       starts_at=datetime(2025, 1, 1, tzinfo=UTC))
    t0 = datetime(2025, 1, 10, tzinfo=UTC)
    events = [usage(org, request_id=f"ev-{i}", prompt_tokens=10,
                    event_time=t0 + timedelta(seconds=i)) for i in range(90)]
    barrier = threading.Barrier(2)
    results: dict[str, list] = {}
    errors: list[BaseException] = []

    def worker(name: str, batch: list) -> None:
        try:
            with transaction.atomic():
                barrier.wait(timeout=10)
                results[name] = rate_usage_batch(batch)
                time.sleep(0.3)  # hold the transaction open, as a big ingest batch would
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=worker, args=("a", events[:60])),
               threading.Thread(target=worker, args=("b", events[30:]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    by_id: dict[str, object] = {}
    for name, batch in (("a", events[:60]), ("b", events[30:])):
        for fact, rating in zip(batch, results[name], strict=True):
            assert by_id.setdefault(fact.request_id, rating) == rating, fact.request_id
    ratings = list(by_id.values())
    assert sum((r.credits_consumed for r in ratings), D("0")) == D("600")
    assert sum((r.overage_credits for r in ratings), D("0")) == D("300")
    # 300 overage credits = 300 input tokens at 1.00 per 1M
    assert sum((r.amount for r in ratings), D("0")) == D("0.0003")
    assert TokenPlanUsage.objects.filter(subscription=sub).count() == 90
    period = TokenPlanPeriod.objects.get(subscription=sub)
    assert (period.plan_credits, period.overage_credits) == (D("600"), D("300"))
