"""The billing invariant: every rated event is billed once, and nothing else is billed as usage.

For each organization and currency, the rated amount of its events up to the end of its open
period (the period its draft bills) must equal the usage and late-usage lines of its finalized
invoices plus those of its draft, exactly (amounts keep 10 places, so also to the cent). A
difference means usage fell off an invoice (a period boundary that skipped events, usage in
another currency than the invoice's, events dated before the first period) or was billed twice.

Events after the open period's end belong to periods still to come and are not compared. Void
invoices count as billed: voiding is a decision about the invoice, not usage left unbilled.

``billing_invariant_check`` returns the differences (a read, one snapshot); the periodic task
calls ``billing_invariant_report``, which logs each difference and publishes the outcome for
``/metrics`` through the cache, since the check runs in a Celery worker and the web process
serves the scrape. It is not an audit row: nobody acted; operators alert on the metric.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.core.cache import cache
from django.db import connection, transaction
from django.db.models import Sum
from django.utils import timezone
from prometheus_client.core import GaugeMetricFamily

from billing_platform.invoicing.builder import build_drafts
from billing_platform.invoicing.choices import InvoiceKind, InvoiceStatus, LineKind
from billing_platform.invoicing.models import InvoiceLine
from billing_platform.invoicing.money import ZERO
from billing_platform.invoicing.selectors import periods_open
from metering.selectors import rated_amounts_before

log = logging.getLogger(__name__)

USAGE_KINDS = (LineKind.USAGE, LineKind.LATE_USAGE)
CACHE_KEY = "invoicing:billing-invariant"


@dataclass(frozen=True, slots=True)
class BillingDifference:
    """One organization's rated usage in one currency that its bills do not match."""

    org_id: int
    currency: str
    rated: Decimal  # events' rated amounts before ``until``
    billed: Decimal  # usage and late-usage lines: finalized invoices and the draft
    until: datetime  # end of the org's open period

    @property
    def difference(self) -> Decimal:
        """Rated minus billed: positive is usage never billed, negative usage billed twice."""
        return self.rated - self.billed


@contextlib.contextmanager
def _snapshot() -> Iterator[None]:
    """One read-only snapshot for every query, so ingest and close running meanwhile can
    never show as a difference (inside a caller's transaction, that one is the snapshot)."""
    if connection.in_atomic_block:
        yield
        return
    with transaction.atomic():
        with connection.cursor() as cur:
            cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        yield


def _billed_on_invoices(org_ids: list[int]) -> dict[tuple[int, str], Decimal]:
    rows = (InvoiceLine.objects
            .filter(invoice__organization_id__in=org_ids, invoice__kind=InvoiceKind.INVOICE,
                    kind__in=USAGE_KINDS)
            .exclude(invoice__status=InvoiceStatus.DRAFT)
            .values("invoice__organization_id", "invoice__currency")
            .annotate(total=Sum("amount_precise")).order_by())
    return {(r["invoice__organization_id"], r["invoice__currency"]): r["total"] for r in rows}


def _chunk_differences(org_ids: list[int]) -> list[BillingDifference]:
    targets = periods_open(org_ids=org_ids)
    until = {t.org_id: t.period_end for t in targets}
    rated = rated_amounts_before(until=until)
    billed: dict[tuple[int, str], Decimal] = defaultdict(lambda: ZERO)
    billed.update(_billed_on_invoices(org_ids))
    for org_id, draft in build_drafts(targets).items():
        billed[(org_id, draft.currency)] += sum(
            (ln.amount_precise for ln in draft.lines if ln.kind in USAGE_KINDS), ZERO)
    out = []
    for org_id, currency in sorted(set(rated) | set(billed)):
        r, b = rated.get((org_id, currency), ZERO), billed.get((org_id, currency), ZERO)
        if r != b:
            out.append(BillingDifference(org_id, currency, r, b, until[org_id]))
    return out


def billing_invariant_check(*, org_ids: Iterable[int] | None = None) -> list[BillingDifference]:
    """Return every (organization, currency) whose rated usage differs from what it is billed.

    An empty list is the invariant holding. Organizations are checked a chunk at a time
    (``INVOICING_CLOSE_CHUNK``), each chunk with the same fixed number of queries as a close.
    """
    from billing_platform.accounts.models import Organization

    orgs = Organization.objects.order_by("id")
    if org_ids is not None:
        orgs = orgs.filter(id__in=list(org_ids))
    chunk = settings.INVOICING_CLOSE_CHUNK
    out: list[BillingDifference] = []
    with _snapshot():
        ids = list(orgs.values_list("id", flat=True))
        for i in range(0, len(ids), chunk):
            out += _chunk_differences(ids[i:i + chunk])
    return out


def billing_invariant_report(*, now: datetime | None = None) -> list[BillingDifference]:
    """Run the check, log each difference, and publish the outcome for ``/metrics``."""
    now = now or timezone.now()
    differences = billing_invariant_check()
    for d in differences:
        log.error("billing invariant broken: organization %s rated %s %s before %s, its "
                  "invoices and draft bill %s (difference %s)", d.org_id, d.rated, d.currency,
                  d.until.isoformat(), d.billed, d.difference)
    per_currency: dict[str, Decimal] = defaultdict(lambda: ZERO)
    for d in differences:
        per_currency[d.currency] += abs(d.difference)
    cache.set(CACHE_KEY, {"checked_at": now.timestamp(),
                          "orgs": len({d.org_id for d in differences}),
                          "difference": {c: str(v) for c, v in per_currency.items()}},
              timeout=None)
    if not differences:
        log.info("billing invariant holds: every rated event is billed once")
    return differences


class BillingInvariantCollector:
    """Expose the last check's outcome (kept in the cache by the worker) on ``/metrics``."""

    def describe(self) -> list[GaugeMetricFamily]:
        return self._families({})

    def collect(self) -> list[GaugeMetricFamily]:
        try:
            state = cache.get(CACHE_KEY) or {}
        except Exception:  # Redis unreachable: the rest of /metrics must still be served
            log.warning("billing invariant state unreadable", exc_info=True)
            state = {}
        return self._families(state)

    @staticmethod
    def _families(state: dict[str, Any]) -> list[GaugeMetricFamily]:
        orgs = GaugeMetricFamily(
            "tollgate_billing_invariant_orgs",
            "Organizations whose rated usage differs from what their invoices and draft bill, "
            "at the last check (0: every rated event is billed once).")
        checked = GaugeMetricFamily(
            "tollgate_billing_invariant_checked_timestamp_seconds",
            "When the billing invariant was last checked (Unix time).")
        amount = GaugeMetricFamily(
            "tollgate_billing_invariant_difference",
            "Sum of |rated - billed| over organizations at the last check, per currency.",
            labels=["currency"])
        if state:
            orgs.add_metric([], state.get("orgs", 0))
            checked.add_metric([], state.get("checked_at", 0))
            for currency, value in sorted(state.get("difference", {}).items()):
                # Prometheus samples are floats; the exact amounts are in the log and the
                # task's result.
                amount.add_metric([currency], float(Decimal(value)))
        return [orgs, checked, amount]
