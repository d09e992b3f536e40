"""Metrics of the gateway: /v1 requests by endpoint, status and error code; the batch backlog.

/v1 is served by a lean ASGI route that no Django middleware sees (``gateway/asgi.py``), so it
observes each answer here itself. The error code (``rate_limit_exceeded``,
``organization_spend_limit_exceeded``, ``resource_unavailable``, ...) is read back from the
OpenAI-shaped body, so every 429 and 5xx is counted by its reason whichever code path made it.
``BatchCollector`` reads the Batch API's backlog when ``/metrics`` is scraped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

from django.db import connection, transaction
from django.db.models import Count, F, Min, Q, Sum
from django.http import HttpResponseBase
from django.utils import timezone
from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

REQUESTS = Counter("tollgate_gateway_requests_total",
                   "Requests answered by /v1, by endpoint, HTTP status and error code ('' for "
                   "a success, or an error without a code).", ["endpoint", "status", "code"])
LATENCY = Histogram("tollgate_gateway_response_start_seconds",
                    "Time from request to response headers on /v1.", ["endpoint"],
                    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                             5, 10, 30))

_CODE = re.compile(r"[a-z0-9_]{1,64}")
UNMETERED_COUNT_CAP = 100_000


def error_code(response: HttpResponseBase) -> str:
    """Return the ``error.code`` of an OpenAI-shaped error response ('' if none)."""
    if response.status_code < 400 or response.streaming:
        return ""
    try:
        code = json.loads(response.content)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return ""
    # codes are ours, but a label must stay a small set whatever a body held
    return code if isinstance(code, str) and _CODE.fullmatch(code) else ""


def request_observed(endpoint: str, response: HttpResponseBase, seconds: float) -> None:
    """Count one /v1 answer and the time to its headers."""
    LATENCY.labels(endpoint).observe(seconds)
    REQUESTS.labels(endpoint, str(response.status_code), error_code(response)).inc()


class BatchCollector:
    """Active batches, the lines they have left, the nearest expiry, and unmetered lines."""

    def collect(self) -> Iterator[Metric]:
        from billing_platform.gateway.models import (
            ACTIVE_STATUSES,
            Batch,
            BatchLine,
            LineState,
        )

        with transaction.atomic(), connection.cursor() as cur:
            cur.execute("SET LOCAL statement_timeout = 2000")
            rows = list(Batch.objects.filter(status__in=ACTIVE_STATUSES).values("status")
                        .annotate(n=Count("id"),
                                  left=Sum(F("total") - F("completed") - F("failed")),
                                  expires=Min("expires_at", filter=Q(status="in_progress")))
                        .order_by("status"))
            unmetered = (BatchLine.objects.filter(metered=False, state=LineState.COMPLETED)
                         [:UNMETERED_COUNT_CAP].count())
        active = GaugeMetricFamily("tollgate_batches_active",
                                   "Batches not yet in a final state, by status.",
                                   labels=["status"])
        left = GaugeMetricFamily("tollgate_batch_lines_remaining",
                                 "Lines of active batches not yet completed or failed.",
                                 labels=["status"])
        counts = {r["status"]: r for r in rows}
        for status in (s.value for s in ACTIVE_STATUSES):
            row = counts.get(status, {})
            active.add_metric([status], row.get("n", 0))
            left.add_metric([status], row.get("left") or 0)
        yield active
        yield left
        expiries = [r["expires"] for r in rows if r["expires"] is not None]
        nearest = GaugeMetricFamily(
            "tollgate_batch_next_expiry_seconds",
            "Seconds until the in-progress batch nearest the end of its completion window "
            "expires (absent when none is in progress; negative: overdue for the sweep).")
        if expiries:
            nearest.add_metric([], (min(expiries) - timezone.now()).total_seconds())
        yield nearest
        yield GaugeMetricFamily(
            "tollgate_batch_lines_unmetered",
            "Completed batch lines whose usage event is not yet on the usage stream (the sweep "
            f"appends them; counted up to {UNMETERED_COUNT_CAP}).", value=unmetered)
