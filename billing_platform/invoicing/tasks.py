"""Celery tasks of invoicing: thin, idempotent; delivery options are the Celery app's
(``billing_platform.celery``: late ack, requeued on worker loss, as every task here checks
state before acting)."""

from __future__ import annotations

from typing import Any

import stripe
from celery import shared_task

from billing_platform.invoicing import services
from billing_platform.invoicing.retention import usage_months_held
from metering.services import usage_partitions_retire

# Only Stripe's transient errors are retried (with backoff); a decline is an outcome, not an
# error, and anything else must surface.
STRIPE_TRANSIENT = (stripe.APIConnectionError, stripe.RateLimitError)


@shared_task(name="invoicing.period_close")
def period_close_task() -> dict[str, Any]:
    """Invoice every organization whose billing period has ended."""
    report = services.period_close_run()
    return {"invoices": report.invoices, "passes": report.passes,
            "failed_orgs": report.failed_orgs}


@shared_task(name="invoicing.charge", autoretry_for=STRIPE_TRANSIENT, retry_backoff=5,
             retry_backoff_max=600, retry_jitter=True, max_retries=10)
def invoice_charge_task(invoice_id: int) -> str:
    """Charge one invoice (never twice: see ``services.invoice_charge``)."""
    return services.invoice_charge(invoice_id=invoice_id)


@shared_task(name="invoicing.refund", autoretry_for=STRIPE_TRANSIENT, retry_backoff=5,
             retry_backoff_max=600, retry_jitter=True, max_retries=10)
def refund_send_task(refund_id: int) -> str:
    """Send one credit note's refund to Stripe (never twice: see ``services.refund_send``)."""
    return services.refund_send(refund_id=refund_id)


@shared_task(name="invoicing.payment_method_save", autoretry_for=STRIPE_TRANSIENT,
             retry_backoff=5, retry_backoff_max=600, retry_jitter=True, max_retries=10)
def payment_method_save_task(organization_id: int, setup_intent_id: str) -> str:
    """Save the card of a SetupIntent Stripe reported succeeded (once: see
    ``payment_methods.payment_method_save_reported``)."""
    from billing_platform.invoicing import payment_methods

    return payment_methods.payment_method_save_reported(organization_id=organization_id,
                                                        setup_intent_id=setup_intent_id)


@shared_task(name="invoicing.dunning")
def dunning_task() -> int:
    """Enqueue a charge for every invoice whose dunning retry is due."""
    due = services.invoices_dunning_run()
    for invoice_id in due:
        invoice_charge_task.delay(invoice_id)
    return len(due)


@shared_task(name="invoicing.payments_sync", autoretry_for=STRIPE_TRANSIENT, retry_backoff=30,
             max_retries=5)
def payments_sync_task() -> int:
    """Settle attempts whose webhook never arrived by reading the PaymentIntent."""
    return services.payments_sync()


@shared_task(name="invoicing.billing_invariant")
def billing_invariant_task() -> dict[str, Any]:
    """Check that every organization's rated usage is billed once; log and publish the rest."""
    from billing_platform.invoicing.invariants import billing_invariant_report

    differences = billing_invariant_report()
    return {"orgs": len({d.org_id for d in differences}),
            "differences": [{"org_id": d.org_id, "currency": d.currency,
                             "difference": str(d.difference)} for d in differences]}


@shared_task(name="invoicing.usage_retire")
def usage_retire_task() -> dict[str, Any]:
    """Apply metering's usage retention, keeping the months billing still reads.

    Here, not in metering's tasks: invoicing decides which months it is done with and calls
    metering (``invoicing -> metering``, never the other way).
    """
    report = usage_partitions_retire(held=usage_months_held)
    return {"horizon": report.horizon.isoformat() if report.horizon else None,
            "retired": report.retired, "held": report.held, "ids_deleted": report.ids_deleted,
            "busy": report.busy}
