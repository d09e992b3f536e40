"""Budget-alert webhooks: signed, delivered by a Celery task with retries, at most once per alert,
never to an address inside the platform's network.

Why a module of its own: the budget sweep (``plans.quotas``) decides that a threshold was
crossed and records a ``BudgetAlert`` (unique per budget, period and threshold); everything
about telling the customer's endpoint lives here, and runs in a worker after that row commits
(``budget_alert_webhook_enqueue``), so a slow or failing endpoint never holds up the sweep.

Delivery contract:

- **At most one delivery per alert.** ``budget_alert_webhook_deliver`` locks the alert's row for
  the attempt and returns at once when the row says it was delivered, or when another worker
  holds the lock (a duplicated task). The one way a receiver can see a second copy is a worker
  that dies after the receiver answered 2xx and before the row committed; every delivery
  carries ``Tollgate-Webhook-Id`` (stable per alert) so a receiver can drop that copy.
- **Retried with backoff.** An answer other than 2xx, a timeout or a connection error is
  recorded on the row (``webhook_status``, ``webhook_attempts``) and raised as
  ``WebhookNotDelivered``, which the task retries (``plans.tasks``). Redirects are never
  followed (as Stripe's webhooks): a 3xx is a failed attempt, so a redirect cannot lead to an
  address the check below refuses.
- **No private destinations.** The URL's host is resolved and EVERY address it resolves to must
  be public (``ipaddress``'s ``is_global``, not multicast): loopback, RFC 1918, link-local
  (169.254.169.254, the cloud metadata service), unique-local, CGNAT and the like are refused,
  also as IPv4-mapped IPv6. The request then goes to the address that was checked (the URL's
  name is kept for the Host header and TLS), so a DNS answer that changes between the check and
  the connection (rebinding) cannot move it. ``settings.WEBHOOK_ALLOW_PRIVATE_ADDRESSES`` turns
  the check off. A refused address is not retried: it stays refused until the URL changes.

No library does this for ``httpx`` (``advocate`` wraps ``requests`` and has had no release
since 2020); the standard library's ``ipaddress`` holds the address rules, this module only
applies them.

Signature scheme (documented for customers): header
``Tollgate-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<raw body>")>``.
Verify by recomputing over the raw body and comparing in constant time; reject a ``t`` older
than 5 minutes.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from billing_platform.accounts.models import Organization
from billing_platform.audit.services import audit_record
from billing_platform.errors import InvalidRequest
from plans.choices import WebhookDeliveryStatus, WebhookEvent
from plans.metrics import budget_webhook_counted, webhook_delivery_counted
from plans.models import BudgetAlert, WebhookAttempt, WebhookDelivery, WebhookEndpoint

log = logging.getLogger(__name__)

TIMEOUT_S = 5.0
STATUS_MAX = 40  # BudgetAlert.webhook_status
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class WebhookNotDelivered(Exception):
    """The endpoint did not answer 2xx (or did not answer); the task retries."""


class WebhookAddressRefused(InvalidRequest):
    """The webhook URL leads to an address inside the platform's network."""

    code = "webhook_address_refused"


# --- signatures ----------------------------------------------------------------------------

def sign_webhook(*, secret: str, body: bytes, timestamp: int | None = None) -> str:
    """Return the ``Tollgate-Signature`` header value for ``body``."""
    ts = int(time.time()) if timestamp is None else timestamp
    mac = hmac.new(secret.encode(), f"{ts}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={ts},v1={mac}"


def verify_webhook(*, secret: str, body: bytes, header: str, tolerance_s: int = 300) -> bool:
    """Return whether ``header`` is a valid, fresh signature of ``body``."""
    try:
        parts = dict(p.split("=", 1) for p in header.split(","))
        ts = int(parts["t"])
    except (KeyError, ValueError):
        return False
    if abs(time.time() - ts) > tolerance_s:
        return False
    expected = sign_webhook(secret=secret, body=body, timestamp=ts).split("v1=", 1)[1]
    return hmac.compare_digest(expected, parts.get("v1", ""))


# --- the address guard ---------------------------------------------------------------------

def _refused(address: IPAddress) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return not address.is_global or address.is_multicast


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidRequest("The webhook URL must be an http or https URL with a host.",
                             param="webhook_url")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise InvalidRequest("The webhook URL has an invalid port.", param="webhook_url") from None
    return parts.hostname, port


def _addresses(host: str, port: int, *, numeric_only: bool = False) -> list[IPAddress]:
    """Return every address ``host`` resolves to (only a numeric host when ``numeric_only``)."""
    flags = socket.AI_NUMERICHOST if numeric_only else 0
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=flags)
    # the scope of a link-local IPv6 address ("fe80::1%eth0") is not part of the address
    return list(dict.fromkeys(ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
                              for info in infos))


def _private_allowed() -> bool:
    return bool(getattr(settings, "WEBHOOK_ALLOW_PRIVATE_ADDRESSES", False))


def webhook_url_check(*, url: str) -> None:
    """Refuse, when it is set, a webhook URL whose host is a non-public address written out.

    Called where budgets are written: it resolves no name (a host that resolves to a private
    address only later is refused at delivery, see ``webhook_destination``), but it catches
    numeric hosts in any form the resolver accepts (``127.1``, ``2130706433``, ``[::1]``) and
    ``localhost``.
    """
    if not url or _private_allowed():
        return
    host, port = _host_port(url)
    if host == "localhost" or host.endswith(".localhost"):
        raise WebhookAddressRefused("The webhook URL may not point at this platform's own "
                                    "host.", param="webhook_url")
    try:
        addresses = _addresses(host, port, numeric_only=True)
    except (socket.gaierror, UnicodeError, ValueError):
        return  # a name: checked when it is resolved, at delivery
    if any(_refused(a) for a in addresses):
        raise WebhookAddressRefused("The webhook URL may not point at a private, loopback, "
                                    "link-local or other non-public address.",
                                    param="webhook_url")


@dataclass(frozen=True)
class Destination:
    """Where one delivery goes: the URL to connect to (at a checked address) and its host."""

    url: httpx.URL
    host_header: str
    sni_hostname: str | None


def webhook_destination(*, url: str) -> Destination:
    """Resolve ``url`` and return where to connect; refuse it if any address is not public.

    Raises ``WebhookAddressRefused`` (not retried) or ``WebhookNotDelivered`` (resolution
    failed: retried).
    """
    host, port = _host_port(url)
    try:
        addresses = _addresses(host, port)
    except (socket.gaierror, UnicodeError) as exc:
        raise WebhookNotDelivered(f"failed: dns {type(exc).__name__}") from exc
    if not _private_allowed():
        refused = [str(a) for a in addresses if _refused(a)]
        if refused:
            raise WebhookAddressRefused(f"{host} resolves to a non-public address "
                                        f"({', '.join(refused)}).", param="webhook_url")
    parsed = httpx.URL(url)
    default_port = 443 if parsed.scheme == "https" else 80
    host_header = parsed.host if port == default_port else f"{parsed.host}:{port}"
    return Destination(url=parsed.copy_with(host=str(addresses[0]), port=port),
                       host_header=host_header,
                       sni_hostname=parsed.host if parsed.scheme == "https" else None)


# --- delivery ------------------------------------------------------------------------------

def _alert_data(alert: BudgetAlert) -> dict[str, Any]:
    budget = alert.budget
    return {"type": "budget.threshold_reached", "budget": budget.public_id,
            "organization": budget.organization.public_id,
            "project": budget.project.public_id if budget.project is not None else None,
            "threshold": alert.threshold, "spend": str(alert.spend),
            "amount": str(budget.amount), "currency": budget.currency,
            "period_start": alert.period_start.isoformat(), "hard": budget.hard,
            "alert_id": alert.id}


def webhook_payload(*, alert: BudgetAlert) -> bytes:
    """Return the JSON body of one alert's webhook (the customer-facing contract)."""
    return json.dumps(_alert_data(alert), separators=(",", ":")).encode()


def webhook_id(*, alert: BudgetAlert) -> str:
    """Return the delivery id a receiver deduplicates on: one per alert, kept across retries."""
    return f"balert_{alert.id}"


def _send(*, url: str, secret: str, body: bytes, delivery_id: str) -> str:
    """Make one signed POST of ``body`` to ``url``; return the answer's status code, or raise
    ``WebhookNotDelivered`` (retried) or ``WebhookAddressRefused`` (not)."""
    destination = webhook_destination(url=url)
    headers = {"Host": destination.host_header, "Content-Type": "application/json",
               "User-Agent": "Tollgate-Webhooks/1", "Tollgate-Webhook-Id": delivery_id,
               "Tollgate-Signature": sign_webhook(secret=secret, body=body)}
    extensions = {"sni_hostname": destination.sni_hostname} if destination.sni_hostname else {}
    # trust_env=False: no proxy from the environment, so the checked address is the one reached
    with httpx.Client(timeout=TIMEOUT_S, follow_redirects=False, trust_env=False) as client:
        request = client.build_request("POST", destination.url, content=body, headers=headers,
                                       extensions=extensions)
        try:
            response = client.send(request, stream=True)  # the answer's body is never read
        except httpx.HTTPError as exc:
            raise WebhookNotDelivered(f"failed: {type(exc).__name__}") from exc
        response.close()
    status = str(response.status_code)
    if not status.startswith("2"):
        raise WebhookNotDelivered(status)
    return status


def _post(alert: BudgetAlert) -> str:
    """Make one attempt of a budget's own webhook; return the answer's status code, or raise."""
    budget = alert.budget
    return _send(url=budget.webhook_url, secret=budget.webhook_secret,
                 body=webhook_payload(alert=alert), delivery_id=webhook_id(alert=alert))


def budget_alert_webhook_deliver(*, alert_id: int, last_attempt: bool = False) -> str:
    """Post one alert's webhook unless it was delivered; return what happened.

    Returns ``delivered``, ``refused`` (the address guard), or, changing nothing,
    ``already_delivered``, ``in_progress`` (another worker holds the alert), ``no_webhook``
    or ``no_alert``. Raises ``WebhookNotDelivered`` after recording a failed attempt, for the
    task to retry; ``last_attempt`` marks the one after which it gives up.
    """
    failure: WebhookNotDelivered | None = None
    with transaction.atomic():
        alert = (BudgetAlert.objects.select_for_update(skip_locked=True, of=("self",))
                 .select_related("budget__organization", "budget__project")
                 .filter(pk=alert_id).first())
        if alert is None:
            return ("in_progress" if BudgetAlert.objects.filter(pk=alert_id).exists()
                    else "no_alert")
        if alert.webhook_delivered_at is not None:
            return "already_delivered"
        if not alert.budget.webhook_url:
            return "no_webhook"
        outcome = "delivered"
        try:
            alert.webhook_status = _post(alert)
            alert.webhook_delivered_at = timezone.now()
        except WebhookAddressRefused as exc:
            outcome = "refused"
            alert.webhook_status = "refused: non-public address"
            log.warning("budget alert %s: webhook refused: %s", alert.id, exc.message)
        except WebhookNotDelivered as exc:
            outcome, failure = "failed", exc
            alert.webhook_status = str(exc)[:STATUS_MAX]
        alert.webhook_attempts += 1
        alert.save(update_fields=["webhook_status", "webhook_delivered_at", "webhook_attempts"])
    return _settled(budget_webhook_counted, outcome, failure, last_attempt=last_attempt,
                    what=f"budget alert {alert_id}: webhook", attempts=alert.webhook_attempts)


def _settled(counted: Callable[[str], None], outcome: str, failure: WebhookNotDelivered | None,
             *, last_attempt: bool, what: str, attempts: int) -> str:
    """Count an attempt's outcome; raise its failure for the task to retry (counted and logged
    as abandoned on the last attempt); else return the outcome."""
    counted(outcome)
    if failure is not None:
        if last_attempt:
            counted("abandoned")
            log.error("%s not delivered after %d attempts (last: %s)", what, attempts, failure)
        raise failure
    return outcome


def budget_alert_webhook_enqueue(*, alert: BudgetAlert) -> None:
    """Deliver ``alert``'s webhook from a worker once the caller's transaction commits."""
    from plans.tasks import budget_alert_webhook  # the tasks module imports the services

    alert_id = alert.id
    transaction.on_commit(lambda: budget_alert_webhook.delay(alert_id))


# --- the organization's endpoints ------------------------------------------------------------
#
# Besides a budget's own webhook URL, an organization registers endpoints that receive every
# event of the organization (a budget alert of any of its budgets, a test event), each delivery
# logged with its attempts. Same signature, same address guard, same retries as above.

MAX_ENDPOINTS = 10  # per organization: each event is posted to every one of them
DELIVERY_LOG = 50  # deliveries the console shows


def webhook_endpoint_create(*, organization: Organization, url: str, description: str = "",
                            acting_user: Any) -> tuple[WebhookEndpoint, str]:
    """Register an endpoint; return it and its signing secret (shown once by the caller)."""
    webhook_url_check(url=url)
    _host_port(url)
    with transaction.atomic():
        Organization.objects.select_for_update().filter(pk=organization.pk).first()
        if WebhookEndpoint.objects.filter(organization=organization,
                                          disabled_at__isnull=True).count() >= MAX_ENDPOINTS:
            raise InvalidRequest(f"An organization has at most {MAX_ENDPOINTS} webhook "
                                 "endpoints; disable one first.", param="url")
        secret = f"whsec_{secrets.token_hex(24)}"
        endpoint = WebhookEndpoint.objects.create(organization=organization, url=url,
                                                  description=description, secret=secret)
        audit_record(acting_user=acting_user, organization=organization,
                     action="webhook_endpoint.create", target=endpoint.public_id,
                     after={"url": url, "description": description})
    return endpoint, secret


def webhook_endpoint_disable(*, endpoint: WebhookEndpoint, acting_user: Any) -> WebhookEndpoint:
    """Stop sending to ``endpoint`` (its delivery log stays); idempotent."""
    with transaction.atomic():
        endpoint = WebhookEndpoint.objects.select_for_update().get(pk=endpoint.pk)
        if endpoint.disabled_at is None:
            endpoint.disabled_at = timezone.now()
            endpoint.save(update_fields=["disabled_at"])
            audit_record(acting_user=acting_user, organization=endpoint.organization_id,
                         action="webhook_endpoint.disable", target=endpoint.public_id,
                         before={"url": endpoint.url})
    return endpoint


def _event_body(*, organization: Organization, event_type: str, event_id: str,
                data: dict[str, Any]) -> str:
    return json.dumps({"id": event_id, "type": event_type, "created": int(time.time()),
                       "organization": organization.public_id, "data": data},
                      separators=(",", ":"))


def _enqueue(deliveries: list[WebhookDelivery]) -> None:
    from plans.tasks import webhook_delivery  # the tasks module imports this one

    ids = [d.id for d in deliveries]
    transaction.on_commit(lambda: [webhook_delivery.delay(i) for i in ids])


def webhook_event_emit(*, organization: Organization, event_type: str, event_id: str,
                       data: dict[str, Any]) -> list[WebhookDelivery]:
    """Record one delivery of an event per enabled endpoint of ``organization`` (once per
    endpoint and event id, however often it is called) and post them after the caller's
    transaction commits."""
    body = _event_body(organization=organization, event_type=event_type, event_id=event_id,
                       data=data)
    made = []
    with transaction.atomic():
        for endpoint in WebhookEndpoint.objects.filter(organization=organization,
                                                       disabled_at__isnull=True):
            delivery, created = WebhookDelivery.objects.get_or_create(
                endpoint=endpoint, event_id=event_id,
                defaults={"event_type": event_type, "payload": body})
            if created:
                made.append(delivery)
        _enqueue(made)
    return made


def budget_alert_emit(*, alert: BudgetAlert) -> list[WebhookDelivery]:
    """Send a budget alert to the organization's endpoints (call in the alert's transaction)."""
    return webhook_event_emit(organization=alert.budget.organization,
                              event_type=WebhookEvent.BUDGET_THRESHOLD_REACHED,
                              event_id=webhook_id(alert=alert), data=_alert_data(alert))


def webhook_test_send(*, endpoint: WebhookEndpoint, acting_user: Any) -> WebhookDelivery:
    """Send a ``webhook.test`` event to ``endpoint`` alone (also a disabled one's check)."""
    with transaction.atomic():
        event_id = f"evt_test_{secrets.token_hex(12)}"
        delivery = WebhookDelivery.objects.create(
            endpoint=endpoint, event_id=event_id, event_type=WebhookEvent.TEST,
            payload=_event_body(organization=endpoint.organization, event_type=WebhookEvent.TEST,
                                event_id=event_id,
                                data={"endpoint": endpoint.public_id,
                                      "message": "A test event from the Tollgate console."}))
        audit_record(acting_user=acting_user, organization=endpoint.organization_id,
                     action="webhook_endpoint.test", target=endpoint.public_id,
                     after={"delivery": delivery.public_id})
        _enqueue([delivery])
    return delivery


def webhook_delivery_resend(*, delivery: WebhookDelivery, acting_user: Any) -> WebhookDelivery:
    """Post a failed delivery again (the same body and id); a delivered one stays as it is."""
    with transaction.atomic():
        # one conditional UPDATE (not a lock held around the check): a second click finds it
        # pending and changes nothing
        if WebhookDelivery.objects.filter(pk=delivery.pk, status=WebhookDeliveryStatus.FAILED
                                          ).update(status=WebhookDeliveryStatus.PENDING):
            audit_record(acting_user=acting_user, organization=delivery.endpoint.organization_id,
                         action="webhook_delivery.resend", target=delivery.public_id)
            _enqueue([delivery])
    delivery.refresh_from_db()
    return delivery


def webhook_delivery_attempt(*, delivery_id: int, last_attempt: bool = False) -> str:
    """Make one attempt of a pending delivery, logging it; return what happened.

    Returns ``delivered``, ``refused``, or, changing nothing, ``already_delivered``,
    ``not_pending`` or ``no_delivery``. Raises ``WebhookNotDelivered`` after logging a failed
    attempt, for the task to retry; ``last_attempt`` marks the delivery failed instead of
    pending after it. A row another transaction holds (a worker posting it, a resend being
    written) is retried too, unlogged: returning would drop a delivery a resend just made
    pending.
    """
    failure: WebhookNotDelivered | None = None
    with transaction.atomic():
        delivery = (WebhookDelivery.objects.select_for_update(skip_locked=True, of=("self",))
                    .select_related("endpoint").filter(pk=delivery_id).first())
        if delivery is None:
            if WebhookDelivery.objects.filter(pk=delivery_id).exists():
                raise WebhookNotDelivered("in_progress")
            return "no_delivery"
        if delivery.status == WebhookDeliveryStatus.DELIVERED:
            return "already_delivered"
        if delivery.status != WebhookDeliveryStatus.PENDING:
            return "not_pending"
        endpoint = delivery.endpoint
        outcome, started = "delivered", time.monotonic()
        try:
            delivery.last_status = _send(url=endpoint.url, secret=endpoint.secret,
                                         body=delivery.payload.encode(),
                                         delivery_id=delivery.event_id)
            delivery.status, delivery.delivered_at = (WebhookDeliveryStatus.DELIVERED,
                                                      timezone.now())
        except WebhookAddressRefused as exc:
            outcome = "refused"
            delivery.status, delivery.last_status = (WebhookDeliveryStatus.REFUSED,
                                                     "refused: non-public address")
            log.warning("webhook delivery %s: refused: %s", delivery.public_id, exc.message)
        except WebhookNotDelivered as exc:
            outcome, failure = "failed", exc
            delivery.last_status = str(exc)[:STATUS_MAX]
            if last_attempt:
                delivery.status = WebhookDeliveryStatus.FAILED
        delivery.attempts += 1
        WebhookAttempt.objects.create(delivery=delivery, status=delivery.last_status,
                                      duration_ms=int((time.monotonic() - started) * 1000))
        delivery.save(update_fields=["status", "last_status", "delivered_at", "attempts"])
    return _settled(webhook_delivery_counted, outcome, failure, last_attempt=last_attempt,
                    what=f"webhook delivery {delivery_id}", attempts=delivery.attempts)
