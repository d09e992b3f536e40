"""The console's Reservations page (``/console/reservations/``, issue 19 item 4): every
reservation of the organization (offering, units, term, renewal, status), one reservation's
utilization per hour over the last 24 hours or 7 days (used vs reserved normalized tokens per
hour and in the busiest minute, and the share that spilled over to on-demand) as charts and a
table of the same figures, and buying or renewing.

Whether owners and admins buy and renew themselves or send a request that staff act on is
``settings.RESERVATIONS_SELF_SERVE`` (``TOLLGATE_RESERVATIONS_SELF_SERVE``, off by default):
self-serve calls ``plans.services.reservation_create`` / ``reservation_renew`` (billed on the
invoice of the period each term starts in), otherwise ``reservation_request`` records the
request in the audit log. Both need ``org.write``; everyone in the organization reads the page.
Figures come from ``plans.selectors.reservation_utilization``. Forms post to this same URL
(``action`` says which) and run once per form key (``once.run_once``); a refusal is a form
message. Another organization's reservation id reads as nothing: 404 in the URL, a form error
in a form. Chart data rides in ``json_script`` (``reservation_charts.js`` draws it; the CSP
forbids inline script).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, cast

from django import forms
from django.conf import settings
from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone

from billing_platform.accounts.models import User
from billing_platform.accounts.selectors import OrgAccess
from billing_platform.audit.models import AuditEvent
from billing_platform.audit.selectors import audit_events
from billing_platform.console.once import OnceForm, run_once
from billing_platform.console.templatetags.money import money
from billing_platform.console.views import org_page
from plans import services
from plans.choices import ReservationTerm
from plans.models import ProvisionedOffering, Reservation
from plans.selectors import (
    HOUR,
    ReservationUtilization,
    offerings_visible,
    reservation_utilization,
    reservations_of,
)

RANGES = {"24h": ("Last 24 hours, by hour", timedelta(hours=24)),
          "7d": ("Last 7 days, by hour", timedelta(days=7))}
DEFAULT_RANGE = "24h"
MAX_TERMS = 36


# --- forms -------------------------------------------------------------------------------------

class RangeForm(forms.Form):
    """Which reservation the charts show, over which range (a GET form)."""

    reservation = forms.CharField(required=False, max_length=40)
    range = forms.ChoiceField(label="Range", required=False,
                              choices=[(k, label) for k, (label, _) in RANGES.items()])


class ReservationBuyForm(OnceForm):
    offering = forms.ChoiceField(label="Offering", help_text="A model in a region; each unit "
                                 "serves the offering's normalized tokens per minute.")
    units = forms.IntegerField(label="Units", min_value=1, max_value=10_000)
    term = forms.ChoiceField(label="Term", choices=ReservationTerm.choices,
                             help_text="Billed per unit per hour or per month, in advance.")
    term_count = forms.IntegerField(label="Number of terms", min_value=1, max_value=MAX_TERMS,
                                    initial=1)
    note = forms.CharField(label="Note to staff", required=False, max_length=500,
                           help_text="Only with a request: anything staff should know.")

    def __init__(self, *args: Any, offerings: list[tuple[str, str]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cast(forms.ChoiceField, self.fields["offering"]).choices = offerings


class ReservationRenewForm(OnceForm):
    reservation = forms.ChoiceField(label="Reservation")
    term_count = forms.IntegerField(label="Number of terms", min_value=1, max_value=MAX_TERMS,
                                    initial=1, help_text="The renewal starts when the "
                                    "reservation ends (now, if it has ended), same units, "
                                    "at today's prices.")

    def __init__(self, *args: Any, reservations: list[tuple[str, str]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cast(forms.ChoiceField, self.fields["reservation"]).choices = reservations


# --- the page ----------------------------------------------------------------------------------

def _status(reservation: Reservation, now: datetime) -> str:
    if now < reservation.starts_at:
        return "Scheduled"
    return "Active" if reservation.covers(now) else "Ended"


def _offerings(access: OrgAccess) -> list[ProvisionedOffering]:
    return list(offerings_visible(staff=False).filter(currency=access.organization.currency))


def _offering_choices(offerings: list[ProvisionedOffering]) -> list[tuple[str, str]]:
    return [(o.code, f"{o.name}: {o.model} in {o.region}, {o.tokens_per_minute_per_unit:,} "
             f"tokens/min a unit, {money(o.hourly_unit_price, o.currency)}/unit-hour or "
             f"{money(o.monthly_unit_price, o.currency)}/unit-month") for o in offerings]


def _renew_choices(reservations: list[Reservation]) -> list[tuple[str, str]]:
    return [(r.public_id, f"{r.public_id}: {r.units} units of {r.model} in {r.region}, ends "
             f"{r.ends_at:%Y-%m-%d %H:%M} UTC") for r in reservations]


def _request_row(row: AuditEvent) -> dict[str, Any]:
    """A request to staff as the page lists it (its audit row's ``after``)."""
    after = row.after or {}
    fee = after.get("fee")
    return {**after, "id": row.public_id, "at": row.created_at, "by": row.actor_label,
            "fee": Decimal(str(fee)) if fee is not None else None}


def _chart_specs(util: ReservationUtilization) -> dict[str, dict[str, Any]]:
    labels = [f"{h.hour:%m-%d %H}:00" for h in util.hours]
    hourly = {"type": "bar", "stacked": True, "labels": labels, "datasets": [
        {"label": "Used (provisioned)", "data": [h.used for h in util.hours]},
        {"label": "Spillover (on-demand)", "data": [h.spillover for h in util.hours]},
        {"label": "Reserved", "data": [h.reserved for h in util.hours], "flat": True}]}
    minute = {"type": "bar", "labels": labels, "datasets": [
        {"label": "Busiest minute used", "data": [h.peak_minute_used for h in util.hours]},
        {"label": "Reserved per minute", "data": [h.reserved_per_minute for h in util.hours],
         "flat": True}]}
    return {"hourly": hourly, "minute": minute}


def _render(request: HttpRequest, access: OrgAccess, *, range_form: RangeForm | None = None,
            buy_form: ReservationBuyForm | None = None,
            renew_form: ReservationRenewForm | None = None, status: int = 200
            ) -> HttpResponse:
    org, now = access.organization, timezone.now()
    reservations = list(reservations_of(organization=org).select_related("offering"))
    range_form = range_form or RangeForm(request.GET or None)
    chosen, range_key = None, DEFAULT_RANGE
    if range_form.is_valid():
        range_key = range_form.cleaned_data["range"] or DEFAULT_RANGE
        wanted = range_form.cleaned_data["reservation"]
        if wanted:
            chosen = next((r for r in reservations if r.public_id == wanted), None)
            if chosen is None:  # another organization's, or none at all: nothing here
                raise Http404("No such reservation.")
    elif range_form.is_bound:
        status = max(status, 400)
    if chosen is None:  # the first one in force, else the newest
        chosen = next((r for r in reservations if r.covers(now)),
                      reservations[0] if reservations else None)
    end = now.replace(minute=0, second=0, microsecond=0) + HOUR
    util = (reservation_utilization(reservation=chosen, start=end - RANGES[range_key][1],
                                    end=end) if chosen is not None else None)

    can_change = access.can("org.write")
    self_serve = bool(settings.RESERVATIONS_SELF_SERVE)
    offerings = _offerings(access)
    if can_change:
        buy_form = buy_form or ReservationBuyForm(offerings=_offering_choices(offerings))
        renew_form = renew_form or ReservationRenewForm(
            reservations=_renew_choices(reservations))
    requests = [_request_row(row) for row in audit_events(
        organization=org, action=services.RESERVATION_REQUEST)[:20]]
    return render(request, "console/reservations.html", {
        "rows": [{"r": r, "status": _status(r, now)} for r in reservations],
        "chosen": chosen, "util": util, "range_form": range_form, "range_key": range_key,
        "range_label": RANGES[range_key][0], "charts": _chart_specs(util) if util else None,
        "can_change": can_change, "self_serve": self_serve, "offerings": offerings,
        "buy_form": buy_form if can_change else None,
        "renew_form": renew_form if can_change and reservations else None,
        "requests": requests,
    }, status=status)


def _buy(request: HttpRequest, access: OrgAccess, self_serve: bool) -> HttpResponse:
    org, user = access.organization, cast(User, request.user)
    offerings = _offerings(access)
    form = ReservationBuyForm(request.POST, offerings=_offering_choices(offerings))
    if form.is_valid():
        data = form.cleaned_data
        offering = next(o for o in offerings if o.code == data["offering"])

        def buy() -> str:
            if self_serve:
                r = services.reservation_create(
                    organization=org, offering=offering, units=data["units"], term=data["term"],
                    term_count=data["term_count"], acting_user=user)
                return (f"Reserved {r.units} units of {offering.name} from "
                        f"{r.starts_at:%Y-%m-%d %H:%M} to {r.ends_at:%Y-%m-%d %H:%M} UTC: "
                        f"{money(r.fee, r.currency)}, billed on your invoices as each term "
                        "starts.")
            request_id = services.reservation_request(
                organization=org, offering=offering, units=data["units"], term=data["term"],
                term_count=data["term_count"], note=data["note"], acting_user=user)
            return (f"Request {request_id} sent: staff will set up {data['units']} units of "
                    f"{offering.name}. Nothing is reserved or billed until they do.")

        operation = ["reservation.buy" if self_serve else "reservation.request",
                     org.public_id, form.audited()]
        if run_once(request, form, operation=operation, call=buy):
            return redirect("console:reservations")
    return _render(request, access, buy_form=form, status=400)


def _renew(request: HttpRequest, access: OrgAccess, self_serve: bool) -> HttpResponse:
    org, user = access.organization, cast(User, request.user)
    reservations = list(reservations_of(organization=org).select_related("offering"))
    form = ReservationRenewForm(request.POST, reservations=_renew_choices(reservations))
    if form.is_valid():
        data = form.cleaned_data
        old = next(r for r in reservations if r.public_id == data["reservation"])

        def renew() -> str:
            if self_serve:
                new = services.reservation_renew(reservation=old, term_count=data["term_count"],
                                                 acting_user=user)
                return (f"Renewed {old.public_id} as {new.public_id}, "
                        f"{new.starts_at:%Y-%m-%d %H:%M} to {new.ends_at:%Y-%m-%d %H:%M} UTC: "
                        f"{money(new.fee, new.currency)}.")
            request_id = services.reservation_request(
                organization=org, offering=old.offering, units=old.units, term=old.term,
                term_count=data["term_count"], renews=old, acting_user=user)
            return (f"Request {request_id} sent: staff will renew {old.public_id}. Nothing is "
                    "reserved or billed until they do.")

        operation = ["reservation.renew" if self_serve else "reservation.request",
                     org.public_id, form.audited()]
        if run_once(request, form, operation=operation, call=renew):
            return redirect("console:reservations")
    return _render(request, access, renew_form=form, status=400)


@org_page()
def page(request: HttpRequest, access: OrgAccess) -> HttpResponse:
    if request.method != "POST":
        return _render(request, access)
    if not access.can("org.write"):
        messages.error(request, f"Your role ({access.role}) cannot buy or renew reservations; "
                                "ask an owner or admin.")
        return _render(request, access, status=403)
    self_serve = bool(settings.RESERVATIONS_SELF_SERVE)
    action = request.POST.get("action")
    if action == "buy":
        return _buy(request, access, self_serve)
    if action == "renew":
        return _renew(request, access, self_serve)
    messages.error(request, "Unknown action; reload the page and try again.")
    return _render(request, access, status=400)
