"""The card an organization's invoices are charged to, saved through a Stripe SetupIntent.

The card number never reaches this platform: the browser gives it to Stripe (Stripe Elements,
``stripe.confirmCardSetup`` with the SetupIntent's client secret) and we only ever see the
PaymentMethod Stripe made of it. We keep no copy either: the Stripe customer's
``invoice_settings.default_payment_method`` is what ``payments.invoice_charge`` charges, so it
is also what the console shows (``payment_method_on_file``), and a card that Stripe updates
(a new expiry from the card network) or a dashboard user replaces is never shown stale.

Replacing the card is two steps, each run once per console form (its idempotency key):

- ``setup_intent_start``: a SetupIntent for the organization's Stripe customer (created once,
  ``payments.billing_account_ensure_customer``), keyed ``org:<id>:setup_intent:<form key>`` so
  that a re-sent form gets the same SetupIntent back from Stripe;
- ``payment_method_replace``, once the browser confirmed it: the SetupIntent is read back from
  Stripe, and only one of this organization's customer that succeeded is taken (an id of
  another organization's SetupIntent is ``NotFound``, as if it did not exist). Its card
  becomes the customer's default; in one transaction an audit row
  (``billing.payment_method_replace``, the card before and after: brand, last4, expiry, never
  more) and the organization's open invoices made due now
  (``payments.open_invoices_charge_now``), whose charges the charge task makes after commit,
  as it does when Stripe reports a new default card (``customer.updated``).

When the browser confirmed the SetupIntent but its form never came back (closed, offline),
Stripe's ``setup_intent.succeeded`` webhook makes up for it: five minutes later (so the form,
which names who saved the card, normally does it first) ``payment_method_save_reported`` saves
the card by the system, unless this SetupIntent's card was saved already or a card was saved
since the SetupIntent was made (a late webhook never brings a replaced card back).

The previous card stays attached to the customer but is no longer charged: Stripe keeps it for
refunds and disputes of the payments it made.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import stripe
from django.db import transaction
from django.utils import timezone

from billing_platform.accounts.models import Organization
from billing_platform.audit.selectors import audit_events
from billing_platform.audit.services import audit_record
from billing_platform.errors import InvalidRequest, NotFound
from billing_platform.invoicing import stripe_client
from billing_platform.invoicing.models import BillingAccount
from billing_platform.invoicing.services.payments import (
    billing_account_ensure_customer,
    open_invoices_charge_now,
)

REPLACED = "billing.payment_method_replace"
BRANDS = {"visa": "Visa", "mastercard": "Mastercard", "amex": "American Express",
          "discover": "Discover", "jcb": "JCB", "diners": "Diners Club",
          "unionpay": "UnionPay"}


@dataclass(frozen=True)
class CardOnFile:
    """A saved card as Stripe describes it: never its number, only what a person recognizes."""

    payment_method_id: str
    brand: str
    last4: str
    exp_month: int
    exp_year: int

    @property
    def brand_name(self) -> str:
        return BRANDS.get(self.brand, self.brand.title() or "Card")

    @property
    def expiry(self) -> str:
        return f"{self.exp_month:02d}/{self.exp_year}"

    def audited(self) -> dict[str, str]:
        return {"payment_method": self.payment_method_id, "brand": self.brand,
                "last4": self.last4, "expiry": self.expiry}


@dataclass(frozen=True)
class SetupStarted:
    """A SetupIntent for the browser to confirm (its client secret is meant for the page)."""

    setup_intent_id: str
    client_secret: str


@dataclass(frozen=True)
class PaymentMethodReplaced:
    card: CardOnFile
    previous: CardOnFile | None
    invoices_due: list[int]


def card_of(payment_method: dict[str, Any]) -> CardOnFile:
    """Return what a PaymentMethod (a dict from Stripe) tells a person about its card."""
    card = payment_method.get("card") or {}
    return CardOnFile(payment_method_id=str(payment_method.get("id") or ""),
                      brand=str(card.get("brand") or ""), last4=str(card.get("last4") or ""),
                      exp_month=int(card.get("exp_month") or 0),
                      exp_year=int(card.get("exp_year") or 0))


def _customer_id(organization: Organization) -> str:
    account = BillingAccount.objects.filter(organization=organization).first()
    return account.stripe_customer_id if account is not None else ""


def payment_method_on_file(*, organization: Organization) -> CardOnFile | None:
    """Return the card the organization's invoices are charged to, if any (asks Stripe).

    An organization that never had a Stripe customer has none, and none is created here.
    """
    customer_id = _customer_id(organization)
    method = stripe_client.default_payment_method_expanded(customer_id) if customer_id else None
    return card_of(method) if method else None


def setup_intent_start(*, organization: Organization, key: str, acting_user: Any
                       ) -> SetupStarted:
    """Create (once per ``key``) a SetupIntent to save a card for the organization.

    Nothing is charged or changed yet, so there is no audit row: the card is audited when it
    replaces the one on file. ``acting_user`` is named in the SetupIntent's metadata.
    """
    account = billing_account_ensure_customer(organization=organization)
    intent = stripe_client.setup_intent_create(
        customer_id=account.stripe_customer_id,
        idempotency_key=f"org:{organization.public_id}:setup_intent:{key}",
        metadata={"organization": organization.public_id,
                  "requested_by": str(getattr(acting_user, "pk", "") or "")})
    return SetupStarted(setup_intent_id=str(intent["id"]),
                        client_secret=str(intent.get("client_secret") or ""))


def setup_intent_of(*, organization: Organization, setup_intent_id: str) -> dict[str, Any]:
    """Return the organization's SetupIntent ``setup_intent_id`` from Stripe.

    One of another organization's customer (or none at all) is ``NotFound``: whoever learns
    an id cannot save, or see, a card through it.
    """
    customer_id = _customer_id(organization)
    if not customer_id or not setup_intent_id.startswith("seti_"):
        raise NotFound("No such card setup.", param="setup_intent")
    try:
        intent = stripe_client.setup_intent_retrieve(setup_intent_id)
    except stripe.InvalidRequestError as exc:
        if exc.http_status == 404:
            raise NotFound("No such card setup.", param="setup_intent") from exc
        raise
    if intent.get("customer") != customer_id:
        raise NotFound("No such card setup.", param="setup_intent")
    return intent


def _replaced_by(organization: Organization, setup_intent_id: str) -> bool:
    """Return whether the card of this SetupIntent replaced the one on file already."""
    return audit_events(organization=organization, action=REPLACED,
                        target=organization.public_id).filter(
        after__setup_intent=setup_intent_id).exists()


def payment_method_replace(*, organization: Organization, setup_intent_id: str,
                           acting_user: Any, now: datetime | None = None
                           ) -> PaymentMethodReplaced:
    """Make the card of a confirmed SetupIntent the organization's payment method.

    Refused (``InvalidRequest``, nothing changed) while the SetupIntent has not succeeded: the
    card was declined, needs 3-D Secure, or was never entered. Done once per SetupIntent (its
    audit row is the record): sent again, it changes nothing and makes nothing due again; sent
    again after Stripe took the card but before the row was written, it finishes the job.
    """
    intent = setup_intent_of(organization=organization, setup_intent_id=setup_intent_id)
    status = str(intent.get("status") or "")
    payment_method = str(intent.get("payment_method") or "")
    if status != "succeeded" or not payment_method:
        error = (intent.get("last_setup_error") or {}).get("message") or ""
        raise InvalidRequest(
            f"The card was not saved: the card setup is {status.replace('_', ' ')}"
            + (f" ({error})" if error else "") + ". Please enter a card again.",
            param="setup_intent")
    card = card_of(stripe_client.payment_method_retrieve(payment_method))
    if _replaced_by(organization, setup_intent_id):
        # done before: never again, not even after a later card replaced this one
        return PaymentMethodReplaced(card=card, previous=None, invoices_due=[])
    previous = payment_method_on_file(organization=organization)
    previous_id = previous.payment_method_id if previous else None
    if previous_id != payment_method:
        stripe_client.customer_default_payment_method_set(
            customer_id=str(intent["customer"]), payment_method_id=payment_method,
            idempotency_key=f"org:{organization.public_id}:default_payment_method:"
                            f"{setup_intent_id}")
    with transaction.atomic():
        BillingAccount.objects.select_for_update().get(organization=organization)  # one at once
        if _replaced_by(organization, setup_intent_id):  # a concurrent send did it
            return PaymentMethodReplaced(card=card, previous=None, invoices_due=[])
        # previous_id may already be this card: Stripe took it, but the row was never written
        # (a crash, Stripe's answer lost); this finishes the replacement
        audit_record(acting_user=acting_user, organization=organization, action=REPLACED,
                     target=organization.public_id,
                     before=previous.audited() if previous and previous_id != payment_method
                     else {},
                     after={**card.audited(), "setup_intent": setup_intent_id})
        due = open_invoices_charge_now(organization_id=organization.pk,
                                       now=now or timezone.now())
    return PaymentMethodReplaced(card=card, previous=previous, invoices_due=due)


# Stripe reports a SetupIntent within a second or so, as the browser posts the console's form;
# the webhook's save waits this long so that the form, which names who saved the card, is the
# one that normally does it, and the webhook only makes up for a form that never came.
REPORTED_SAVE_DELAY_S = 300


def payment_method_save_enqueue(organization_id: int, setup_intent_id: str) -> None:
    """Enqueue the save of a SetupIntent's card that Stripe reported (call it on commit)."""
    from billing_platform.invoicing.tasks import payment_method_save_task  # tasks import us

    payment_method_save_task.apply_async((organization_id, setup_intent_id),
                                         countdown=REPORTED_SAVE_DELAY_S)


def payment_method_save_reported(*, organization_id: int, setup_intent_id: str) -> str:
    """Save the card of a SetupIntent Stripe reports succeeded (``setup_intent.succeeded``),
    for when the browser confirmed it but its form never came back (closed, offline).

    The webhook's copy is not believed: the SetupIntent is read back from Stripe and taken
    only as ``payment_method_replace`` takes it (this organization's, succeeded), once, by
    the system (no acting user). One older than the card saved last is left alone, so a late
    webhook never brings back a card that was replaced since. Returns what was done.
    """
    organization = Organization.objects.get(pk=organization_id)
    if _replaced_by(organization, setup_intent_id):
        return "already saved"
    try:
        intent = setup_intent_of(organization=organization, setup_intent_id=setup_intent_id)
    except NotFound:
        return "ignored: not a card setup of this organization"
    started = datetime.fromtimestamp(int(intent.get("created") or 0), tz=UTC)
    latest = audit_events(organization=organization, action=REPLACED,
                          target=organization.public_id).first()
    if latest is not None and latest.created_at >= started:
        return "ignored: a card saved since replaced it"
    try:
        done = payment_method_replace(organization=organization,
                                      setup_intent_id=setup_intent_id, acting_user=None)
    except InvalidRequest as exc:
        return f"ignored: {exc.message}"
    return f"saved {done.card.brand} {done.card.last4}, {len(done.invoices_due)} invoice(s) due"
