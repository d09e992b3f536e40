"""Console alerts page: the organization's budgets and the alerts they sent, its webhook
endpoints (a signing secret shown once, a test event) and their delivery log with every
attempt. Thin: a form validates, one service in ``plans.webhooks`` acts.

With htmx (django-htmx's ``request.htmx``) the page updates the log in place: a test event or
a resend posted by htmx is answered with the log alone, and while a delivery is pending the log
fetches itself (``?part=deliveries``) every 2 seconds, so its retries show as they happen.
Without JavaScript the same forms post and redirect as before."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render

from billing_platform.accounts.selectors import OrgAccess
from billing_platform.console.views import _new_form_nonce, _take_form_nonce, org_page
from billing_platform.errors import DomainError
from plans import quotas, selectors, webhooks
from plans.choices import WebhookDeliveryStatus, WebhookEvent
from plans.models import WebhookDelivery, WebhookEndpoint


class EndpointForm(forms.Form):
    url = forms.URLField(max_length=2000, label="Endpoint URL", assume_scheme="https",
                         help_text="Where Tollgate posts each event (https, a public address).")
    description = forms.CharField(max_length=200, required=False, label="Description",
                                  help_text="For your own reference, e.g. 'billing alerts'.")


def _deliveries(request: HttpRequest, access: OrgAccess, note: str = "") -> HttpResponse:
    """Answer the delivery log alone (an htmx request's part of the page)."""
    return render(request, "console/_alert_deliveries.html",
                  {**_log(access), "note": note, "can_write": access.can("org.write")})


def _log(access: OrgAccess) -> dict[str, Any]:
    deliveries = selectors.webhook_deliveries_of(organization=access.organization,
                                                 limit=webhooks.DELIVERY_LOG)
    return {"deliveries": deliveries,
            "polling": any(d.status == WebhookDeliveryStatus.PENDING for d in deliveries)}


@org_page()
def page(request: HttpRequest, access: OrgAccess) -> HttpResponse:
    org = access.organization
    if request.method == "GET" and request.GET.get("part") == "deliveries":
        return _deliveries(request, access)
    form = EndpointForm()
    secret = created = None
    if request.method == "POST":
        if not access.can("org.write"):
            refused = f"Your role ({access.role}) cannot change webhooks."
            if request.htmx:  # type: ignore[attr-defined]
                return _deliveries(request, access, refused)
            messages.error(request, refused)
            return redirect("console:alerts")
        action = request.POST.get("action", "")
        if action == "create":
            if not _take_form_nonce(request):  # a reload or a double click: make one endpoint
                messages.info(request, "That form was already submitted; no new endpoint was "
                                       "made.")
                return redirect("console:alerts")
            form = EndpointForm(request.POST)
            if form.is_valid():
                try:
                    created, secret = webhooks.webhook_endpoint_create(
                        organization=org, acting_user=request.user, **form.cleaned_data)
                except DomainError as exc:
                    form.add_error("url", exc.message)
                else:
                    form = EndpointForm()
        else:
            return _act(request, access, action)
    return render(request, "console/alerts.html", {
        "budgets": [quotas.budget_state(budget=b) for b in quotas.budgets_of(organization=org)],
        "alerts": selectors.budget_alerts_of(organization=org, limit=20),
        "endpoints": selectors.webhook_endpoints_of(organization=org),
        **_log(access),
        "form": form, "secret": secret, "created": created,
        "form_nonce": _new_form_nonce(request), "can_write": access.can("org.write"),
        "events": WebhookEvent.choices, "max_endpoints": webhooks.MAX_ENDPOINTS,
    })


def _act(request: HttpRequest, access: OrgAccess, action: str) -> HttpResponse:
    """Disable an endpoint, send it a test event, or send a failed delivery again; another
    organization's id is a 404, as an id that does not exist."""
    org = access.organization
    if action in ("disable", "test"):
        endpoint = get_object_or_404(WebhookEndpoint, organization=org,
                                     public_id=request.POST.get("endpoint", ""))
        if action == "disable":
            webhooks.webhook_endpoint_disable(endpoint=endpoint, acting_user=request.user)
            messages.success(request, f"Endpoint {endpoint.url} disabled; its log stays.")
        else:
            delivery = webhooks.webhook_test_send(endpoint=endpoint, acting_user=request.user)
            note = f"Test event {delivery.event_id} sent to {endpoint.url}."
            if request.htmx:  # type: ignore[attr-defined]
                return _deliveries(request, access, note)
            messages.success(request, f"{note} See the delivery log below.")
    elif action == "resend":
        delivery = get_object_or_404(WebhookDelivery, endpoint__organization=org,
                                     public_id=request.POST.get("delivery", ""))
        webhooks.webhook_delivery_resend(delivery=delivery, acting_user=request.user)
        note = f"Delivery of {delivery.event_id} is being sent again."
        if request.htmx:  # type: ignore[attr-defined]
            return _deliveries(request, access, note)
        messages.success(request, note)
    else:
        messages.error(request, "Unknown action.")
    return redirect("console:alerts")
