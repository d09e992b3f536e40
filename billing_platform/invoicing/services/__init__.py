"""Writes of invoicing, one module per use case.

- ``periods``: period close, every organization's ended period invoiced in bulk;
- ``closing``: that close run now by finance, after a preview that persists nothing;
- ``invoices``: one invoice at a time: finalize a hand-made draft, void;
- ``corrections``: credit notes by amount or by lines (amount due reduced, refund, credit);
- ``refunds``: a credit note's refund sent to Stripe once, after commit;
- ``payments``: charges, dunning, payments recorded by hand;
- ``dunning``: finance's hand on collection: pause and resume, retry now, write off;
- ``items``: one-off items for an organization's next invoice;
- ``webhooks``: what Stripe reports (signed webhooks) and the sync for webhooks lost; apart
  from ``payments`` only so that neither module passes about 500 lines.

Every service that moves money takes keyword-only ``acting_user`` (None for the system: the
beat, a webhook) and writes its audit row in its own transaction. Reads (periods due or open,
the upcoming invoice) are in ``invoicing.selectors``. The names below are re-exported so that
``from billing_platform.invoicing import services`` and ``services.<name>`` keep working.
"""

from billing_platform.invoicing.selectors import periods_due, periods_open, upcoming_invoice
from billing_platform.invoicing.services.closing import (
    ClosedInvoice,
    ClosedLine,
    CloseResult,
    period_close_now,
    period_close_preview,
)
from billing_platform.invoicing.services.corrections import LineCredit, credit_note_create
from billing_platform.invoicing.services.dunning import (
    invoice_charge_retry,
    invoice_dunning_pause,
    invoice_dunning_resume,
    invoice_write_off,
)
from billing_platform.invoicing.services.invoices import invoice_finalize, invoice_void
from billing_platform.invoicing.services.items import invoice_item_create
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
from billing_platform.invoicing.services.refunds import refund_send
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
    "CloseResult",
    "ClosedInvoice",
    "ClosedLine",
    "LineCredit",
    "PayloadTooLarge",
    "WebhookNotConfigured",
    "_charge_attempt_begin",  # the payment tests drive a charge's two steps apart
    "_charge_attempt_send",
    "billing_account_ensure_customer",
    "credit_note_create",
    "invoice_charge",
    "invoice_charge_retry",
    "invoice_dunning_pause",
    "invoice_dunning_resume",
    "invoice_finalize",
    "invoice_item_create",
    "invoice_mark_paid",
    "invoice_void",
    "invoice_write_off",
    "invoices_dunning_run",
    "payments_sync",
    "period_close_now",
    "period_close_preview",
    "period_close_run",
    "periods_due",
    "periods_open",
    "refund_send",
    "stripe_webhook_receive",
    "upcoming_invoice",
]
