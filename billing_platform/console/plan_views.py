"""The console's Plan & credits page (``/console/plan/``): the subscription in force, a token
plan's credits left (period, rolling window, packs), buying a credit pack, and subscribing,
upgrading, downgrading or cancelling after a preview of what the invoice will bill.

Everyone in the organization reads the page; buying and changing need ``org.write`` (the
permission ``/api/v1``'s pack purchase asks), the plan-advice panel ``billing.read``. Credits
come from ``plans.selectors.token_plan_status``, the read behind ``/api/v1/.../subscription``.

The preview is the real change, rolled back: the service runs inside a transaction, the
upcoming invoice is built by invoicing's one builder (``upcoming_invoice``, which prorates plan
fees with ``plans.selectors.subscription_months_in_period``), and the transaction is undone. So
the preview cannot disagree with the invoice, and refuses what the change would refuse. The
confirm form carries the previewed plan fees; the change runs again at confirm time and is
refused, and previewed anew, if the seconds since moved a fee by a cent. Every POST runs once
per form key (``idempotency.idempotent_call``); a refusal is a form message, nothing written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any, cast

from django.contrib import messages
from django.core.cache import cache
from django.db import transaction
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from billing_platform.accounts.models import Organization, User
from billing_platform.accounts.selectors import OrgAccess
from billing_platform.console import forms
from billing_platform.console.once import OnceForm, run_once
from billing_platform.console.templatetags.credits import credits as credits_text
from billing_platform.console.templatetags.money import money
from billing_platform.console.views import org_page
from billing_platform.errors import Conflict, DomainError
from billing_platform.invoicing.advice import last_closed_period, plan_advice_for
from billing_platform.invoicing.builder import DraftInvoice, DraftLine
from billing_platform.invoicing.choices import LineKind
from billing_platform.invoicing.selectors import upcoming_invoice
from plans import services
from plans.models import Plan, Subscription
from plans.selectors import (
    TokenPlanStatus,
    credit_packs_offered,
    pack_purchases_of,
    plans_offered,
    subscription_at,
    token_plan_status,
)

ZERO = Decimal("0")


# --- the preview -------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChangePreview:
    """The upcoming invoice's plan fees before and after a change made at ``at``."""

    at: datetime
    period_start: datetime
    period_end: datetime
    currency: str
    before: list[DraftLine]
    after: list[DraftLine]
    total_before: Decimal
    total_after: Decimal

    @property
    def fees_before(self) -> Decimal:
        return sum((ln.amount for ln in self.before), ZERO)

    @property
    def fees_after(self) -> Decimal:
        return sum((ln.amount for ln in self.after), ZERO)

    @property
    def difference(self) -> Decimal:
        return self.total_after - self.total_before

    @property
    def later_period(self) -> bool:
        """True when the invoice still open is of a period that ended before ``at`` (not
        closed yet): the change is billed on the invoice after it."""
        return self.period_end <= self.at

    @property
    def expected(self) -> str:
        """The fees the confirm form carries: each plan-fee line's billed amount."""
        return ",".join(str(ln.amount) for ln in self.after)


def _fees(draft: DraftInvoice) -> list[DraftLine]:
    return [ln for ln in draft.lines if ln.kind == LineKind.PLAN_FEE]


Change = Callable[[datetime], Any]


def change_preview(*, organization: Organization, change: Change,
                   at: datetime | None = None) -> ChangePreview:
    """Return what the upcoming invoice bills in plan fees now and after ``change(at)``.

    ``change`` is the service call itself; it runs in a transaction that is rolled back, so
    nothing of it stays (its audit row included) and its domain errors reach the caller.
    """
    at = at or timezone.now()
    before = upcoming_invoice(organization=organization, now=at)
    with transaction.atomic():
        change(at)
        after = upcoming_invoice(organization=organization, now=at)
        transaction.set_rollback(True)
    return ChangePreview(at=at, period_start=after.target.period_start,
                         period_end=after.target.period_end, currency=after.currency,
                         before=_fees(before), after=_fees(after),
                         total_before=before.total, total_after=after.total)


def _change_confirmed(*, organization: Organization, change: Change, expected: str) -> Any:
    """Make the change now, refused (rolled back) when its fees are not the previewed ones."""
    at = timezone.now()
    with transaction.atomic():
        result = change(at)
        fees = ",".join(str(ln.amount) for ln in
                        _fees(upcoming_invoice(organization=organization, now=at)))
        if fees != expected:
            raise Conflict("The prorated fees changed since your preview (time passed); "
                           "check the new figures and confirm again.", param="expected")
    return result


# --- the page ----------------------------------------------------------------------------------

ADVICE_TTL_S = 900


@dataclass(frozen=True)
class AdviceSummary:
    """The plan advisor's answer for the last closed period, as the page's panel shows it."""

    period_start: datetime
    period_end: datetime
    currency: str
    billed: Decimal
    cheapest: str
    cheapest_total: Decimal
    saving: Decimal


def _advice(organization: Organization) -> AdviceSummary | None:
    """Return the advice panel's figures, None before a period has closed.

    Cached for 15 minutes per organization and period: the advisor replays the period's
    every event (3.4 s for a million, bench/plan_advisor.py), too slow for each page load,
    and a closed period changes only by late usage. /console/plan-advice/ computes afresh.
    """
    period = last_closed_period(organization=organization)
    if period is None:
        return None
    key = f"console:plan-advice:{organization.public_id}:{period[0].isoformat()}"
    summary = cache.get(key)
    if summary is None:
        advice = plan_advice_for(organization=organization, start=period[0], end=period[1])
        summary = AdviceSummary(
            period_start=advice.period_start, period_end=advice.period_end,
            currency=advice.currency, billed=advice.current.total,
            cheapest=advice.cheapest.name, cheapest_total=advice.cheapest.total,
            saving=advice.saving)
        cache.set(key, summary, ADVICE_TTL_S)
    return cast(AdviceSummary, summary)


def _pack_choices(sub: Subscription | None) -> list[tuple[str, str]]:
    if sub is None:
        return []
    currency = sub.plan.currency
    return [(p.code, f"{p.name} ({credits_text(p.credits)} credits, {money(p.price, currency)})")
            for p in credit_packs_offered(plan=sub.plan)]


def _plan_page(request: HttpRequest, access: OrgAccess, *,
               pack_form: forms.CreditPackBuyForm | None = None, status: int = 200
               ) -> HttpResponse:
    org = access.organization
    sub = subscription_at(organization=org)
    can_change = access.can("org.write")
    choices = _pack_choices(sub)
    if pack_form is None and can_change and choices:
        pack_form = forms.CreditPackBuyForm(packs=choices)
    credits = token_plan_status(subscription=sub) if sub else None
    return render(request, "console/plan.html", {
        "subscription": sub, "credits": credits, **_left(credits),
        "packs": credit_packs_offered(plan=sub.plan) if sub else [],
        "purchases": pack_purchases_of(subscription=sub)[:20] if sub else [],
        "offered": [p for p in plans_offered(currency=org.currency)
                    if sub is None or p.pk != sub.plan_id],
        "can_change": can_change, "pack_form": pack_form if can_change else None,
        "advice": _advice(org) if access.can("billing.read") else None,
    }, status=status)


def _left(credits: TokenPlanStatus | None) -> dict[str, Decimal | None]:
    """Return the plan credits left in the period and in the window, each cap alone."""
    if credits is None:
        return {}
    window = (None if credits.window_credits is None
              else max(credits.window_credits - credits.window_used, ZERO))
    return {"period_left": max(credits.period_credits - credits.period_used, ZERO),
            "window_left": window}


@org_page()
def plan(request: HttpRequest, access: OrgAccess) -> HttpResponse:
    return _plan_page(request, access)


def _subscription(access: OrgAccess, sub_id: str) -> Subscription:
    return get_object_or_404(Subscription.objects.select_related("plan"),
                             organization=access.organization, public_id=sub_id)


@org_page("org.write")
@require_POST
def pack_buy(request: HttpRequest, access: OrgAccess, sub_id: str) -> HttpResponse:
    sub = _subscription(access, sub_id)
    form = forms.CreditPackBuyForm(request.POST, packs=_pack_choices(sub))
    if form.is_valid():
        pack = credit_packs_offered(plan=sub.plan).get(code=form.cleaned_data["pack"])

        def buy() -> str:
            purchase = services.credit_pack_purchase(subscription=sub, pack=pack,
                                                     acting_user=request.user)
            return (f"Bought {pack.name}: {credits_text(purchase.credits)} credits; "
                    f"{money(purchase.price, purchase.currency)} on your next invoice.")

        if run_once(request, form, operation=["credit_pack.purchase", access.organization
                                               .public_id, sub.public_id, pack.code], call=buy):
            return redirect("console:plan")
    return _plan_page(request, access, pack_form=form, status=400)


def _change_page(request: HttpRequest, access: OrgAccess, *, sub: Subscription | None,
                 target: Plan | None, form: OnceForm, refused: list[str] | None = None,
                 status: int = 200) -> HttpResponse:
    """Preview the change (again) and show its confirm form; a refusal is the page's message
    (and no confirm button)."""
    org, preview = access.organization, None
    refused = list(refused or [])
    try:
        preview = change_preview(organization=org, change=_change(request, org, sub, target))
    except DomainError as exc:
        if exc.message not in refused:  # the confirm's refusal, said again by the preview
            refused.append(exc.message)
        status = 400
    else:
        for error in form.non_field_errors():  # a bound form's (a damaged key): say it
            messages.error(request, str(error))
        form = type(form)(initial={"plan": target.code if target else "",
                                   "expected": preview.expected},
                          **({"plans": _plan_choices(org)} if target else {}))
    if sub is not None:
        sub.refresh_from_db()  # the preview's change was rolled back
    return render(request, "console/plan_change.html", {
        "subscription": sub, "target": target, "preview": preview, "form": form,
        "refused": refused, "credits": token_plan_status(subscription=sub) if sub else None,
    }, status=status)


def _plan_choices(org: Organization) -> list[tuple[str, str]]:
    return [(p.code, p.name) for p in plans_offered(currency=org.currency)]


def _change(request: HttpRequest, org: Organization, sub: Subscription | None,
            target: Plan | None) -> Change:
    """Return the service call of the change: subscribe, move to ``target``, or cancel.

    It reads the subscription afresh first: a preview's rolled-back change leaves the
    in-memory object as the change made it.
    """
    user = cast(User, request.user)  # signed in

    def change(at: datetime) -> Any:
        if sub is None:
            assert target is not None  # nothing to cancel without a subscription  # noqa: S101
            return services.subscription_create(organization=org, plan=target, starts_at=at,
                                                acting_user=user)
        sub.refresh_from_db()
        if target is None:
            return services.subscription_cancel(subscription=sub, at=at, acting_user=user)
        return services.subscription_change(subscription=sub, plan=target, at=at,
                                            acting_user=user)

    return change


def _confirm(request: HttpRequest, access: OrgAccess, *, sub: Subscription | None,
             target: Plan | None, form: OnceForm) -> HttpResponse:
    org = access.organization
    change = _change(request, org, sub, target)
    done = f"You are now on {target.name}." if target else "Your plan is cancelled."

    def confirm() -> str:
        _change_confirmed(organization=org, change=change,
                          expected=form.cleaned_data["expected"])
        return done

    operation = ["subscription.change", org.public_id, sub.public_id if sub else "",
                 target.code if target else ""]
    if run_once(request, form, operation=operation, call=confirm):
        return redirect("console:plan")
    refused = [str(e) for field in ("__all__", "expected") for e in form.errors.get(field, [])]
    return _change_page(request, access, sub=sub, target=target, form=type(form)(
        **({"plans": _plan_choices(org)} if target else {})), refused=refused, status=400)


@org_page("org.write")
def plan_change(request: HttpRequest, access: OrgAccess, sub_id: str | None = None
                ) -> HttpResponse:
    """Subscribe (no ``sub_id``) or move the subscription to another plan: a GET previews
    (``?plan=<code>``), a POST confirms."""
    org = access.organization
    sub = _subscription(access, sub_id) if sub_id else None
    choices = _plan_choices(org)
    data = request.POST if request.method == "POST" else None
    form = forms.PlanChangeForm(data, plans=choices)
    code = (request.POST if data is not None else request.GET).get("plan", "")
    target = plans_offered(currency=org.currency).filter(code=code).first()
    if target is None:
        messages.error(request, "Choose one of the plans offered.")
        return redirect("console:plan")
    if data is not None and form.is_valid():
        return _confirm(request, access, sub=sub, target=target, form=form)
    return _change_page(request, access, sub=sub, target=target, form=form,
                        status=400 if data is not None else 200)


@org_page("org.write")
def plan_cancel(request: HttpRequest, access: OrgAccess, sub_id: str) -> HttpResponse:
    """Cancel the subscription now (the organization is on-demand after): a GET previews, a
    POST confirms."""
    sub = _subscription(access, sub_id)
    data = request.POST if request.method == "POST" else None
    form = forms.PlanCancelForm(data)
    if data is not None and form.is_valid():
        return _confirm(request, access, sub=sub, target=None, form=form)
    return _change_page(request, access, sub=sub, target=None, form=form,
                        status=400 if data is not None else 200)
