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
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from billing_platform.errors import InvalidRequest
from plans.metrics import budget_webhook_counted
from plans.models import BudgetAlert

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

def webhook_payload(*, alert: BudgetAlert) -> bytes:
    """Return the JSON body of one alert's webhook (the customer-facing contract)."""
    budget = alert.budget
    payload = {"type": "budget.threshold_reached", "budget": budget.public_id,
               "organization": budget.organization.public_id,
               "project": budget.project.public_id if budget.project is not None else None,
               "threshold": alert.threshold, "spend": str(alert.spend),
               "amount": str(budget.amount), "currency": budget.currency,
               "period_start": alert.period_start.isoformat(), "hard": budget.hard,
               "alert_id": alert.id}
    return json.dumps(payload, separators=(",", ":")).encode()


def webhook_id(*, alert: BudgetAlert) -> str:
    """Return the delivery id a receiver deduplicates on: one per alert, kept across retries."""
    return f"balert_{alert.id}"


def _post(alert: BudgetAlert) -> str:
    """Make one attempt; return the answer's status code, or raise."""
    budget = alert.budget
    destination = webhook_destination(url=budget.webhook_url)
    body = webhook_payload(alert=alert)
    headers = {"Host": destination.host_header, "Content-Type": "application/json",
               "User-Agent": "Tollgate-Webhooks/1", "Tollgate-Webhook-Id": webhook_id(alert=alert),
               "Tollgate-Signature": sign_webhook(secret=budget.webhook_secret, body=body)}
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
    budget_webhook_counted(outcome)
    if failure is not None:
        if last_attempt:
            budget_webhook_counted("abandoned")
            log.error("budget alert %s: webhook not delivered after %d attempts (last: %s)",
                      alert_id, alert.webhook_attempts, failure)
        raise failure
    return outcome


def budget_alert_webhook_enqueue(*, alert: BudgetAlert) -> None:
    """Deliver ``alert``'s webhook from a worker once the caller's transaction commits."""
    from plans.tasks import budget_alert_webhook  # the tasks module imports the services

    alert_id = alert.id
    transaction.on_commit(lambda: budget_alert_webhook.delay(alert_id))
