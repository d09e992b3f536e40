"""End to end through a real Celery worker: the beat task closes the period and the charge
task it enqueues pays the invoice through localstripe, exactly once even when re-sent."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from billing_platform.invoicing import stripe_client
from billing_platform.invoicing.choices import PaymentStatus
from billing_platform.invoicing.models import Invoice, PaymentAttempt
from billing_platform.invoicing.tasks import invoice_charge_task, period_close_task
from plans import services as plan_services
from tests.conftest import wait_until
from tests.factories import make_billed_org, make_offering, make_price_book
from tests.invoicing.test_invoice_payments import _set_default_card


@pytest.mark.django_db(transaction=True)
def test_beat_close_enqueues_a_charge_that_the_worker_pays_once(stripe_settings,
                                                                 celery_worker_process):
    make_price_book(prices=[{"model": "m-big", "input": "3.00", "output": "15.00"}])
    # an org and a reservation since the start of last month: exactly one period has ended
    # (the task closes every ended period; fixed dates gave one more invoice each month)
    last_month = (datetime.now(tz=UTC).replace(day=1) - timedelta(days=1)).replace(
        day=1, hour=0, minute=0, second=0, microsecond=0)
    org = make_billed_org(name="Worker Co", created_at=last_month)
    plan_services.reservation_create(organization=org, offering=make_offering(model="m-big"),
                                     units=1, term="monthly", starts_at=last_month)
    customer_id = _set_default_card(org, "pm_card_visa")
    worker = celery_worker_process(queues="billing", env={
        "STRIPE_API_BASE": stripe_settings.STRIPE_API_BASE,
        "STRIPE_API_KEY": stripe_settings.STRIPE_API_KEY})

    # when beat's period-close task runs (twice)
    period_close_task.delay()
    period_close_task.delay()

    # then last month is invoiced once and charged once by the worker
    def charged():
        attempt = PaymentAttempt.objects.filter(invoice__organization=org).first()
        return attempt if attempt and attempt.status == PaymentStatus.SUCCEEDED else None

    attempt = wait_until(charged, timeout=60, what=f"the charge (log: {worker.log_path})")
    invoice = Invoice.objects.get(organization=org)
    assert invoice.total == attempt.amount == 100

    # a re-sent charge task charges nothing more
    invoice_charge_task.delay(invoice.id).get(timeout=30)
    assert PaymentAttempt.objects.filter(invoice=invoice).count() == 1
    assert len(stripe_client.client().v1.charges.list({"customer": customer_id}).data) == 1
    assert Invoice.objects.filter(organization=org).count() == 1
