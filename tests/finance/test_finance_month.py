"""A month of traffic for three organizations in two currencies, through the live gateway (the
official ``openai`` SDK) and the external ingest API, then period close: the revenue,
receivables and credits reports equal hand computations from what the clients sent and were
told (token counts in the responses, the events as posted).

A: USD, gateway traffic (default and priority tiers), 10 % tax, a 1.00 promotional credit.
B: EUR, gateway traffic and events reported through ``/api/v1/usage/events``, a 0.50 EUR
   credit that expires unused.
C: USD, events reported through the ingest API only.

Prices per 1M tokens (from the month's start): USD as ``test_invoice_gateway`` sets them,
EUR 1800 / 180 / 5400. Every event's class amount is rounded to 10 places as rating does, each
invoice line once to the cent.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import timedelta
from decimal import ROUND_HALF_EVEN, Context, Decimal, localcontext

from django.db.models import Sum
from django.utils import timezone

from billing_platform.finance import reports
from billing_platform.invoicing import services
from billing_platform.invoicing.models import Invoice
from metering.models import UsageEvent
from plans import services as plan_services
from plans.models import PriceBook
from tests.factories import make_billed_org, make_key, make_price_book
from tests.gateway.conftest import live_gateway  # noqa: F401 - the live gateway fixture
from tests.invoicing.conftest import billing_invariant_holds  # noqa: F401 - autouse check
from tests.invoicing.test_invoice_gateway import (  # noqa: F401 - month: the month's prices
    PRICES,
    TIERS,
    M,
    Sent,
    _client,
    _ingested,
    _send,
    cents,
    month,
)

EUR_PRICES = {"input": Decimal("1800"), "cached_input": Decimal("180"),
              "output": Decimal("5400")}
TEN = Decimal("1E-10")
D = Decimal


def _lines(sent: list[Sent], prices: dict[str, Decimal]) -> dict[tuple, Decimal]:
    """Hand-rate: per event and class tokens x price x tier / 1M at 10 places, summed per
    invoice line (tier x region x class), then each line rounded once."""
    lines: dict[tuple, Decimal] = defaultdict(Decimal)
    with localcontext(Context(prec=100)):
        for s in sent:
            for cls, tokens in s.classes():
                exact = tokens * prices[cls] * TIERS[s.tier] / M
                lines[(s.tier, s.region, cls)] += exact.quantize(TEN, rounding=ROUND_HALF_EVEN)
    return {k: v for k, v in lines.items() if v}


def _post_events(api_client, org, events: list[dict]) -> list[Sent]:
    """Report events through the ingest API (a key with the admin scope); return them."""
    _, secret = make_key(project=org.projects.first(), scopes=["admin"])
    reply = api_client.post("/api/v1/usage/events", {"events": events}, format="json",
                            HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert reply.status_code == 200 and reply.json()["recorded"] == len(events), reply.content
    return [Sent(f"ext:{e['id']}", "default", "external", "on_demand", e["prompt_tokens"],
                 e.get("cached_tokens", 0), e["completion_tokens"]) for e in events]


def test_a_month_in_two_currencies_reports_what_was_sent(live_gateway, month,  # noqa: F811
                                                         api_client):
    start, end = month
    eur = make_price_book(currency="EUR", prices=[
        {"model": "small", **{k: str(v) for k, v in EUR_PRICES.items()}}],
        effective_from=start)
    assert PriceBook.objects.get(currency="EUR", is_default=True) == eur
    a = make_billed_org(name="Alpha", created_at=start, tax_rate="0.10")
    b = make_billed_org(name="Beta", created_at=start, currency="EUR")
    c = make_billed_org(name="Gamma", created_at=start)
    plan_services.credit_grant_create(organization=a, kind="promotional", amount="1.00",
                                      granted_at=start, expires_at=end + timedelta(days=30))
    breakage_at = timezone.now()
    plan_services.credit_grant_create(organization=b, kind="promotional", amount="0.50",
                                      granted_at=start, expires_at=breakage_at)

    # given traffic: A through the gateway, B through the gateway and the ingest API, C the API
    client_a = _client(live_gateway, a)
    sent_a = [_send(client_a), _send(client_a, content="Name three rivers.", tier="priority")]
    client_b = _client(live_gateway, b)
    sent_b = [_send(client_b, content="Name three lakes.", max_tokens=60)]
    when = (start + (timezone.now() - start) / 2).isoformat()
    sent_b += _post_events(api_client, b, [
        {"id": "b-1", "model": "small", "prompt_tokens": 1234, "cached_tokens": 234,
         "completion_tokens": 567, "event_time": when}])
    sent_c = _post_events(api_client, c, [
        {"id": f"c-{i}", "model": "small", "prompt_tokens": 1000 + i, "completion_tokens": 333,
         "event_time": when} for i in range(3)])
    _ingested(sent_a + sent_b[:1])
    lines = {"A": _lines(sent_a, PRICES), "B": _lines(sent_b, EUR_PRICES),
             "C": _lines(sent_c, PRICES)}
    exact = {"USD": sum(lines["A"].values()) + sum(lines["C"].values()),
             "EUR": sum(lines["B"].values())}

    def revenue() -> reports.RevenueReport:
        return reports.revenue_report(report_filter=reports.RevenueFilter(
            start=start, end=end, org_id=None))

    # then before the close the month is accrued: exactly the rated events, nothing billed
    before = {t.currency: t for t in revenue().currency_totals}
    assert {c: t.accrued_precise for c, t in before.items()} == exact
    assert {c: t.accrued for c, t in before.items()} == {c: cents(v) for c, v in exact.items()}
    assert all(t.billed == 0 for t in before.values())
    rated = UsageEvent.objects.filter(organization_id__in=[a.id, b.id, c.id]).values(
        "currency").annotate(s=Sum("amount"))
    assert {r["currency"]: r["s"] for r in rated} == exact

    # when the month is closed
    closed = services.period_close_run(now=end + timedelta(hours=1), enqueue_payments=False,
                                       org_ids=[a.id, b.id, c.id])
    assert closed.invoices == 3

    # then billed revenue is each invoice as computed by hand: lines rounded once, tax on the
    # subtotal less the promotional credit; accrued is nothing any more
    subtotal = {k: sum(cents(v) for v in ls.values()) for k, ls in lines.items()}
    tax_a = cents((subtotal["A"] - D("1.00")) * D("0.10"))  # the promotional credit before tax
    total = {"A": subtotal["A"] + tax_a - D("1.00"), "B": subtotal["B"], "C": subtotal["C"]}
    assert subtotal["A"] > D("1.00"), "the credit must be used up"
    after = revenue()
    assert {(t.currency, t.billed, t.accrued) for t in after.currency_totals} == {
        ("USD", total["A"] + total["C"], D("0")), ("EUR", total["B"], D("0"))}
    usage = {(r.currency, r.service_tier, r.region, r.token_class): r.billed
             for r in after.rows if r.kind == "usage"}
    assert usage == {**{("USD", *key): cents(v) for org in "AC" for key, v in lines[org].items()},
                     **{("EUR", *key): cents(v) for key, v in lines["B"].items()}}
    others = {(r.currency, r.kind): r.billed for r in after.rows if r.kind != "usage"}
    assert others == {("USD", "tax"): tax_a, ("USD", "credit"): D("-1.00")}
    assert {(t.currency, t.billed) for t in after.currency_totals} == {
        (cur, Invoice.objects.filter(currency=cur, period_start=start).aggregate(
            s=Sum("total"))["s"]) for cur in ("USD", "EUR")}

    # and receivables, ten days past the due date: every invoice open, in the 0-30 bucket
    invoice_a = Invoice.objects.get(organization=a)
    as_of = invoice_a.due_at + timedelta(days=10)
    receivables = reports.receivables_report(
        report_filter=reports.ReceivablesFilter(as_of=as_of))
    assert {(r.organization_name, r.amount_due, r.bucket, r.days_past_due)
            for r in receivables.rows} == {
        ("Alpha", total["A"], "0-30", 10), ("Beta", total["B"], "0-30", 10),
        ("Gamma", total["C"], "0-30", 10)}
    summaries = {s.currency: s for s in receivables.summaries}
    assert (summaries["USD"].open, summaries["USD"].days_0_30) == (
        total["A"] + total["C"], total["A"] + total["C"])
    assert summaries["EUR"].open == total["B"]
    # all of it billed within the 90 days before: DSO = open / billed x 90 = 90
    assert {s.dso_days for s in summaries.values()} == {D("90.0")}

    # and credits over the month and the day after its close: A's 1.00 granted and consumed by
    # the close, B's 0.50 EUR expired unused (breakage)
    credits = reports.credits_report(report_filter=reports.CreditsFilter(
        start=start, end=end + timedelta(days=1)))
    assert [(t.currency, t.granted, t.consumed, t.expired, t.closing)
            for t in credits.totals] == [("EUR", D("0.50"), D("0"), D("0.50"), D("0")),
                                         ("USD", D("1.00"), D("1.00"), D("0"), D("0"))]
