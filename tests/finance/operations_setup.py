"""What the finance operations tests share: invoices made by the real services, paid through
the Stripe stand-in with the official library, and a POST that carries an Idempotency-Key."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from billing_platform.audit.models import AuditEvent
from billing_platform.invoicing import services, stripe_client
from billing_platform.invoicing.choices import InvoiceStatus
from billing_platform.invoicing.models import Invoice
from plans import services as plan_services
from tests.factories import make_billed_org, make_offering, make_price_book
from tests.invoicing.conftest import NOV, OCT

API = "/api/v1/finance"


def last_month_start() -> datetime:
    """The start of the previous calendar month (UTC): exactly one period of it has ended."""
    this_month = datetime.now(tz=UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    return (this_month - timedelta(days=1)).replace(day=1)


def price_book() -> None:
    make_price_book(prices=[{"model": "m-small", "input": "1.00", "output": "2.00"},
                            {"model": "m-big", "input": "3.00", "output": "15.00"}])


def reserved_invoice(name: str, *, tax_rate: str = "0") -> Invoice:
    """An open October invoice of a new org: a 200.00 reservation fee (plus tax)."""
    org = make_billed_org(name=name, tax_rate=tax_rate)
    plan_services.reservation_create(organization=org, offering=make_offering(model="m-big"),
                                     units=2, term="monthly", starts_at=OCT)
    services.period_close_run(now=NOV + timedelta(hours=1), enqueue_payments=False,
                              org_ids=[org.id])
    invoice = Invoice.objects.get(organization=org, period_start=OCT)
    assert invoice.status == InvoiceStatus.OPEN
    return invoice


def set_default_card(org, pm_alias: str = "pm_card_visa") -> str:
    """Attach a test card as the customer's default (as the console's card form does)."""
    account = services.billing_account_ensure_customer(organization=org)
    client = stripe_client.client()
    pm = client.v1.payment_methods.attach(pm_alias, {"customer": account.stripe_customer_id})
    client.v1.customers.update(account.stripe_customer_id,
                               {"invoice_settings": {"default_payment_method": pm.id}})
    return account.stripe_customer_id


def pay_through_stripe(invoice: Invoice) -> Invoice:
    """Charge the invoice's card through Stripe and settle it as Stripe reports it."""
    set_default_card(invoice.organization)
    assert services.invoice_charge(invoice_id=invoice.id) == "succeeded"
    assert services.payments_sync(older_than=timedelta(0)) == 1  # Stripe's answer read back
    invoice.refresh_from_db()
    assert invoice.status == InvoiceStatus.PAID
    return invoice


def post(client, path: str, body: dict, *, key: str | None = None):
    """POST JSON to ``/api/v1/finance/<path>`` with an Idempotency-Key (a fresh one if none)."""
    return client.post(f"{API}/{path}", body, format="json",
                       HTTP_IDEMPOTENCY_KEY=key or uuid.uuid4().hex)


class NewRows:
    """The audit rows written since this object was made, oldest first."""

    def __init__(self) -> None:
        self.last = AuditEvent.objects.order_by("-id").values_list("id", flat=True).first() or 0

    def __call__(self, action: str | None = None) -> list[AuditEvent]:
        rows = AuditEvent.objects.filter(id__gt=self.last).order_by("id")
        return list(rows.filter(action=action) if action else rows)
