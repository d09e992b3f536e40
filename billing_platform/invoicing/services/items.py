"""One-off items (an onboarding fee) that finance adds to an organization's next invoice.

An item is pending until the period close that creates the organization's next invoice bills
it: the builder reads the pending items with the rest of the invoice (so the upcoming invoice
and the close preview show them), and the close marks each billed by its invoice in the same
transaction, taking only items still pending (``periods._consume_items``): billed exactly once.
It is in the organization's currency at the time it is added and taxed with the invoice's
other charges.

A void of the invoice that billed an item does not put it back: voiding is a decision about
that invoice's whole content (its usage counts as billed too, see ``invariants``), often made
because a charge was not owed, and an item that came back by itself would bill the customer
again for what finance just cancelled. When it is still owed, finance adds it again, which
leaves an audit row naming who decided it.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django.db import transaction

from billing_platform.accounts.models import Organization
from billing_platform.audit.services import audit_record
from billing_platform.errors import InvalidRequest
from billing_platform.invoicing.models import PendingInvoiceItem
from billing_platform.invoicing.money import quantize_money

MAX_ITEM_AMOUNT = Decimal("1000000000")  # far above any fee, far below the column's range


@transaction.atomic
def invoice_item_create(*, organization: Organization, description: str, amount: Decimal,
                        reason: str, acting_user: Any) -> PendingInvoiceItem:
    """Add a one-off charge (before tax) to the organization's next invoice."""
    currency = organization.currency
    if not isinstance(amount, Decimal) or not amount.is_finite() or amount <= 0 or \
            quantize_money(amount, currency) != amount or amount > MAX_ITEM_AMOUNT:
        raise InvalidRequest(f"amount must be a positive amount in {currency}'s minor unit, "
                             f"at most {MAX_ITEM_AMOUNT}.", param="amount")
    amount = quantize_money(amount, currency)  # the same value, at the currency's places
    description = description.strip()
    if not description or len(description) > 300:
        raise InvalidRequest("description must be 1 to 300 characters.", param="description")
    item = PendingInvoiceItem.objects.create(organization=organization, description=description,
                                             amount=amount, currency=currency)
    audit_record(acting_user=acting_user, organization=organization,
                 action="invoice_item.create", target=item.public_id,
                 after={"description": item.description, "amount": str(item.amount),
                        "currency": item.currency, "reason": reason[:500]})
    return item
