"""Writes of invoicing, one module per use case.

- ``periods``: period close, every organization's ended period invoiced in bulk;
- ``invoices``: one invoice at a time: finalize a hand-made draft, void, credit notes;
- ``payments``: charges, dunning, payments recorded by hand;
- ``webhooks``: what Stripe reports (signed webhooks) and the sync for webhooks lost; apart
  from ``payments`` only so that neither module passes about 500 lines.

Every service that moves money takes keyword-only ``acting_user`` (None for the system: the
beat, a webhook) and writes its audit row in its own transaction. Reads (periods due or open,
the upcoming invoice) are in ``invoicing.selectors``. The names below are re-exported so that
``from billing_platform.invoicing import services`` and ``services.<name>`` keep working.
"""

from billing_platform.invoicing.selectors import periods_due, periods_open, upcoming_invoice
from billing_platform.invoicing.services.invoices import (
    credit_note_create,
    invoice_finalize,
    invoice_void,
)
from billing_platform.invoicing.services.payments import (
    _charge_attempt_begin,
    _charge_attempt_send,
    billing_account_ensure_customer,
    invoice_charge,
    invoice_mark_paid,
    invoices_dunning_run,
)
from billing_platform.invoicing.services.periods import (
    MAX_FAILED_ORGS,
    CloseReport,
    period_close_run,
)
from billing_platform.invoicing.services.webhooks import (
    PAYMENT_INTENT_EVENTS,
    STRIPE_WEBHOOK_MAX_BYTES,
    PayloadTooLarge,
    WebhookNotConfigured,
    payments_sync,
    stripe_webhook_receive,
)

__all__ = [
    "MAX_FAILED_ORGS",
    "PAYMENT_INTENT_EVENTS",
    "STRIPE_WEBHOOK_MAX_BYTES",
    "CloseReport",
    "PayloadTooLarge",
    "WebhookNotConfigured",
    "_charge_attempt_begin",  # the payment tests drive a charge's two steps apart
    "_charge_attempt_send",
    "billing_account_ensure_customer",
    "credit_note_create",
    "invoice_charge",
    "invoice_finalize",
    "invoice_mark_paid",
    "invoice_void",
    "invoices_dunning_run",
    "payments_sync",
    "period_close_run",
    "periods_due",
    "periods_open",
    "stripe_webhook_receive",
    "upcoming_invoice",
]
