"""Metrics of invoicing's edges with Stripe: our calls to its API, and its webhooks to us.

A card decline is an outcome Stripe answered (``card_declined``), not a failure of the call;
failures are the other errors the library raises, in a few fixed classes, so every series
exists (at 0) from the start. The billing invariant's gauges are in ``invariants.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import stripe
from prometheus_client import Counter

P = ParamSpec("P")
T = TypeVar("T")

STRIPE_REQUESTS = Counter(
    "tollgate_stripe_requests_total",
    "Calls to Stripe's API by operation and outcome (after the library's own retries): ok, "
    "card_declined (an answer, not a failure), connection_error, rate_limited, api_error "
    "(any other error Stripe answered), error (anything else).", ["operation", "outcome"])
STRIPE_WEBHOOKS = Counter(
    "tollgate_stripe_webhooks_total",
    "Stripe webhook deliveries by outcome: processed, duplicate, ignored, needs_review, "
    "refused (bad signature, no secret set, too large), error (an exception: answered 500, "
    "Stripe retries).", ["outcome"])
REQUEST_OUTCOMES = ("ok", "card_declined", "connection_error", "rate_limited", "api_error",
                    "error")
WEBHOOK_OUTCOMES = ("processed", "duplicate", "ignored", "needs_review", "refused", "error")
# Known label values start at 0, so an alert on increase() sees the first event too.
for _known in WEBHOOK_OUTCOMES:
    STRIPE_WEBHOOKS.labels(_known)


def _outcome(exc: Exception) -> str:
    if isinstance(exc, stripe.CardError):
        return "card_declined"
    if isinstance(exc, stripe.APIConnectionError):
        return "connection_error"
    if isinstance(exc, stripe.RateLimitError):
        return "rate_limited"
    return "api_error" if isinstance(exc, stripe.StripeError) else "error"


def stripe_call(operation: str) -> Callable[[Callable[P, T]], Callable[P, T]]:
    """Count each call of the decorated Stripe operation under its outcome."""
    for outcome in REQUEST_OUTCOMES:
        STRIPE_REQUESTS.labels(operation, outcome)

    def decorator(func: Callable[P, T]) -> Callable[P, T]:
        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
            try:
                result = func(*args, **kwargs)
            except Exception as exc:
                STRIPE_REQUESTS.labels(operation, _outcome(exc)).inc()
                raise
            STRIPE_REQUESTS.labels(operation, "ok").inc()
            return result

        return wrapper

    return decorator


def stripe_webhook_counted(*, outcome: str = "", error: BaseException | None = None) -> None:
    """Count one webhook delivery: a stored event's ``outcome`` text, or the ``error`` raised."""
    if error is not None:
        from billing_platform.errors import DomainError

        label = "refused" if isinstance(error, DomainError) else "error"
    elif outcome.startswith("duplicate"):
        label = "duplicate"
    elif outcome.startswith("ignored"):
        label = "ignored"
    elif outcome.startswith("review:"):
        label = "needs_review"
    else:
        label = "processed"
    STRIPE_WEBHOOKS.labels(label).inc()
