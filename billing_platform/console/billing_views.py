"""The console's billing page (issue 19 item 5): credit balance and grants with their expiry,
the card invoices are charged to and replacing it through a Stripe SetupIntent, the latest
invoices, and links to the billing profile and every invoice.

Reading the page needs ``billing.read`` (owners, admins, the organization's finance role),
the permission ``GET /api/v1/organizations/{id}/credit_grants/`` asks for the same grants,
which come from the same selectors (``plans.selectors.credit_grants_of``, ``credit_balance``).
Replacing the card also needs ``org.write`` (owners and admins): the role that runs the
organization decides what it is charged to. A finance member sees the card but no form, and
a form it posts anyway is refused with a message; nothing is sent to Stripe.

Replacing the card (``invoicing.payment_methods``):

1. "Add a card" posts a one-time key; the service creates the SetupIntent (once per key: a
   re-sent form gets the same one) and the browser is sent to the card page for it.
2. The card page: with ``STRIPE_PUBLISHABLE_KEY`` set, Stripe Elements (Stripe.js from
   https://js.stripe.com, which this page's Content-Security-Policy then allows, as Stripe
   documents: scripts and frames from js.stripe.com, 3-D Secure frames from
   hooks.stripe.com, requests to api.stripe.com) takes the card and confirms the SetupIntent
   in the browser; ``billing_card.js`` then posts the completion form. Without the key no
   Stripe.js is loaded and the page says so: the SetupIntent is confirmed through Stripe's
   API (test mode, as the tests do) and the completion form is posted by hand.
3. The completion form posts the SetupIntent's id with its own one-time key; the service
   reads the SetupIntent back from Stripe (another organization's is a 404), makes its card
   the default and the open invoices due, charged by the charge task after commit.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from typing import Any

import stripe
from django import forms
from django.conf import settings
from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST

from billing_platform.accounts.selectors import OrgAccess
from billing_platform.console.once import OnceForm
from billing_platform.console.views import org_page
from billing_platform.errors import InvalidRequest
from billing_platform.idempotency.services import idempotent_call
from billing_platform.invoicing import payment_methods
from billing_platform.invoicing.choices import InvoiceStatus
from billing_platform.invoicing.selectors import invoices_of
from plans.selectors import credit_balance, credit_grants_of

MANAGE = "org.write"  # with billing.read: who replaces the card
STRIPE_JS = "https://js.stripe.com/v3/"
STRIPE_DOWN = ("Stripe did not answer, so nothing was changed. Please try again in a "
               "moment.")
# What Stripe.js and Elements need (docs.stripe.com/security/guide#content-security-policy),
# added to this page's policy only, and only when Stripe.js is loaded at all.
STRIPE_CSP = {"script-src": ["https://js.stripe.com"],
              "frame-src": ["https://js.stripe.com", "https://hooks.stripe.com"],
              "connect-src": ["'self'", "https://api.stripe.com"]}


class KeyForm(OnceForm):
    """A form that does its work once: the hidden one-time key (idempotency)."""


class CompleteForm(KeyForm):
    setup_intent = forms.RegexField(regex=r"^seti_[A-Za-z0-9_]{1,200}$", max_length=205,
                                    label="Card setup")


def _key() -> str:
    return secrets.token_urlsafe(18)


def _fingerprint(*parts: str) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def _card(access: OrgAccess) -> tuple[payment_methods.CardOnFile | None, str]:
    """Return the card on file, or an explanation when Stripe cannot be asked right now."""
    try:
        return payment_methods.payment_method_on_file(organization=access.organization), ""
    except stripe.StripeError:
        return None, ("The card on file cannot be shown right now (Stripe did not answer); "
                      "invoices are still charged to it.")


@org_page("billing.read")
def billing(request: HttpRequest, access: OrgAccess) -> HttpResponse:
    """Show credits, the card on file and the latest invoices."""
    org = access.organization
    card, card_error = _card(access)
    invoices = invoices_of(organization=org)
    return render(request, "console/billing.html", {
        "balance": sorted(credit_balance(organization=org).items()),
        "grants": list(credit_grants_of(organization=org)[:100]),
        "now": timezone.now(),
        "card": card, "card_error": card_error,
        "can_manage": access.can(MANAGE),
        "invoices": list(invoices[:5]),
        "open_invoices": list(invoices.filter(status=InvoiceStatus.OPEN, amount_due__gt=0)),
        "start_form": KeyForm(initial={"idempotency_key": _key()}),
    })


def _refused(request: HttpRequest, access: OrgAccess) -> HttpResponse | None:
    if access.can(MANAGE):
        return None
    messages.error(request, f"Your role ({access.role}) cannot change the payment method; "
                            "an owner or admin can.")
    return redirect("console:billing")


@org_page("billing.read")
@require_POST
def card_setup_start(request: HttpRequest, access: OrgAccess) -> HttpResponse:
    """Create the SetupIntent for a new card (once per form) and open its card page."""
    refused = _refused(request, access)
    if refused:
        return refused
    form = KeyForm(request.POST)
    if not form.is_valid():
        messages.error(request, "That form was incomplete; please try again.")
        return redirect("console:billing")
    org = access.organization

    def start() -> dict[str, Any]:
        started = payment_methods.setup_intent_start(
            organization=org, key=form.cleaned_data["idempotency_key"],
            acting_user=request.user)
        return {"setup_intent": started.setup_intent_id}

    try:
        result, _ = idempotent_call(
            caller=f"user:{request.user.pk}", key=form.cleaned_data["idempotency_key"],
            fingerprint=_fingerprint("setup_intent_start", org.public_id), call=start)
    except (stripe.APIConnectionError, stripe.RateLimitError, stripe.APIError):
        messages.error(request, STRIPE_DOWN)
        return redirect("console:billing")
    return redirect(f"{reverse('console:billing-card')}?setup_intent={result['setup_intent']}")


@org_page("billing.read")
def card_form(request: HttpRequest, access: OrgAccess) -> HttpResponse:
    """The card form of one SetupIntent of this organization (another's is a 404)."""
    refused = _refused(request, access)
    if refused:
        return refused
    wanted = request.GET.get("setup_intent", "")[:205]
    try:
        intent = payment_methods.setup_intent_of(organization=access.organization,
                                                 setup_intent_id=wanted)
    except (stripe.APIConnectionError, stripe.RateLimitError, stripe.APIError):
        messages.error(request, STRIPE_DOWN)
        return redirect("console:billing")
    publishable_key = settings.STRIPE_PUBLISHABLE_KEY
    response = render(request, "console/billing.html", {
        "setup": {"id": intent["id"], "status": intent.get("status", "")},
        "stripe_js": STRIPE_JS if publishable_key else "",
        "stripe_config": {"publishable_key": publishable_key,
                          "client_secret": intent.get("client_secret") or ""},
        "complete_form": CompleteForm(initial={"idempotency_key": _key(),
                                               "setup_intent": intent["id"]}),
    })
    if publishable_key:
        response._csp_update = STRIPE_CSP  # type: ignore[attr-defined]  # django-csp reads it
    return response


@org_page("billing.read")
@require_POST
def card_setup_complete(request: HttpRequest, access: OrgAccess) -> HttpResponse:
    """Make the confirmed SetupIntent's card the payment method (once per form)."""
    refused = _refused(request, access)
    if refused:
        return refused
    form = CompleteForm(request.POST)
    if not form.is_valid():
        messages.error(request, "The card was not saved: " + "; ".join(
            (f"{form.fields[name].label or name}: " if name in form.fields else "")
            + " ".join(str(e) for e in errors) for name, errors in form.errors.items()))
        return redirect("console:billing")
    org, seti = access.organization, form.cleaned_data["setup_intent"]

    def complete() -> dict[str, Any]:
        done = payment_methods.payment_method_replace(
            organization=org, setup_intent_id=seti, acting_user=request.user)
        card = done.card
        text = f"{card.brand_name} ending in {card.last4} (expires {card.expiry})"
        due = len(done.invoices_due)
        return {"message": f"Saved: invoices are now charged to the {text}."
                + (f" {due} open invoice{'s' if due != 1 else ''} will be charged now."
                   if due else "")}

    try:
        result, replayed = idempotent_call(
            caller=f"user:{request.user.pk}", key=form.cleaned_data["idempotency_key"],
            fingerprint=_fingerprint("payment_method_replace", org.public_id, seti),
            call=complete)
    except InvalidRequest as exc:
        messages.error(request, exc.message)
        return redirect(f"{reverse('console:billing-card')}?setup_intent={seti}")
    except (stripe.APIConnectionError, stripe.RateLimitError, stripe.APIError):
        # the form's key rolled back with everything else: the same form may be sent again
        messages.error(request, STRIPE_DOWN)
        return redirect(f"{reverse('console:billing-card')}?setup_intent={seti}")
    if replayed:
        messages.info(request, f"This form was already sent: {result['message']} "
                               "(nothing was done again).")
    else:
        messages.success(request, result["message"])
    return redirect("console:billing")
