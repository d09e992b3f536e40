"""A month of mixed traffic driven through the live gateway with the official ``openai`` SDK,
then period close: every invoice line equals a hand computation from the token counts the
responses reported.

Three organizations, the current calendar month: one on-demand (cached tokens, priority,
flex, a credit grant, 10 % tax, and an event that arrives after its month was invoiced), one
with a reserved unit that spills over, one on a token plan that crosses its cap into overage.
Closing is run as of the month's end (``now=`` the next month), as the beat task will then.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Context, Decimal, localcontext

import openai
import pytest
from django.utils import timezone

from billing_platform.invoicing import services
from billing_platform.invoicing.choices import InvoiceStatus, LineKind
from billing_platform.invoicing.models import Invoice
from metering.models import UsageEvent
from plans import services as plan_services
from plans.models import PriceBook
from plans.periods import add_months
from tests.conftest import wait_until
from tests.factories import make_billed_org, make_key, make_offering, make_token_plan
from tests.gateway.conftest import drain_usage

M = Decimal(1_000_000)
TEN = Decimal("1E-10")
CENT = Decimal("0.01")
# Prices of `small` from the start of this month (per 1M tokens): high enough that a few
# hundred tokens are cents, so every line's rounding shows.
PRICES = {"input": Decimal("2000"), "cached_input": Decimal("200"), "output": Decimal("6000")}
TIERS = {"default": Decimal(1), "priority": Decimal(2), "flex": Decimal("0.5")}
PROMPT = "Summarize the history of the printing press in Europe. " * 12


@dataclass(frozen=True)
class Sent:
    """One request as the client saw it: billed tier, region, capacity source, tokens."""

    request_id: str
    tier: str
    region: str
    source: str
    prompt: int
    cached: int
    out: int

    def classes(self) -> tuple[tuple[str, int], ...]:
        return (("input", self.prompt - self.cached), ("cached_input", self.cached),
                ("output", self.out))


def cents(value: Decimal) -> Decimal:
    return value.quantize(CENT, rounding=ROUND_HALF_UP)


def _send(client: openai.OpenAI, *, content: str = PROMPT, tier: str | None = None,
          max_tokens: int = 40) -> Sent:
    raw = client.chat.completions.with_raw_response.create(
        model="small", messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
        extra_body={"ignore_eos": True, **({"service_tier": tier} if tier else {})})
    completion = raw.parse()
    details = completion.usage.prompt_tokens_details
    return Sent(raw.headers["x-request-id"], completion.service_tier,
                raw.headers["x-tollgate-region"],
                raw.headers.get("x-tollgate-capacity", "on_demand"),
                completion.usage.prompt_tokens, (details.cached_tokens or 0) if details else 0,
                completion.usage.completion_tokens)


def _expected(sent: list[Sent], fractions: dict[str, Decimal] | None = None,
              free: frozenset[str] = frozenset()) -> dict[tuple, tuple[int, Decimal]]:
    """Hand-rate requests (DESIGN.md): per class, tokens x price x tier / 1M, each event's
    class amount rounded to 10 places; ``fractions``: the billed share of a request;
    ``free``: sources with no per-token charge. Summed per invoice line."""
    lines: dict[tuple, list] = {}
    with localcontext(Context(prec=100)):
        for s in sent:
            for cls, tokens in s.classes():
                amount = tokens * PRICES[cls] * TIERS[s.tier] / M
                amount = (Decimal(0) if s.source in free
                          else amount * (fractions or {}).get(s.request_id, Decimal(1)))
                line = lines.setdefault(("small", s.tier, s.region, s.source, cls),
                                        [0, Decimal(0)])
                line[0] += tokens
                line[1] += amount.quantize(TEN, rounding=ROUND_HALF_EVEN)
    return {k: (q, a) for k, (q, a) in lines.items() if q or a}


def _usage_lines(invoice: Invoice, kind: str = LineKind.USAGE) -> dict[tuple, tuple]:
    return {(ln.model, ln.service_tier, ln.region, ln.capacity_source, ln.token_class):
            (int(ln.quantity), ln.amount_precise, ln.amount)
            for ln in invoice.lines.filter(kind=kind)}


def _as_lines(expected: dict[tuple, tuple[int, Decimal]]) -> dict[tuple, tuple]:
    return {k: (q, a, cents(a)) for k, (q, a) in expected.items()}


def _ingested(sent: list[Sent]) -> None:
    ids = [s.request_id for s in sent]

    def done() -> bool:
        drain_usage()
        return UsageEvent.objects.filter(request_id__in=ids).count() == len(ids)

    wait_until(done, timeout=20, what="every request's usage event ingested")


@pytest.fixture
def month(live_gateway):
    now = timezone.now()
    start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    if add_months(start, 1) - now < timedelta(minutes=10):
        pytest.skip("too close to the end of the month for traffic to stay inside it")
    book = PriceBook.objects.get(currency="USD", is_default=True)
    plan_services.price_version_create(
        price_book=book, effective_from=start, allow_backdate=True,
        prices=[{"model": "small", **{k: str(v) for k, v in PRICES.items()}}])
    return start, add_months(start, 1)


def _client(gateway, org) -> openai.OpenAI:
    _key, secret = make_key(project=org.projects.first(), scopes=["inference"])
    return openai.OpenAI(api_key=secret, base_url=f"{gateway.url}/v1", max_retries=0)


def test_a_month_through_the_gateway_closes_to_hand_computed_lines(live_gateway, month):
    start, end = month
    # A: on-demand, 10 % tax, a 1.00 credit grant
    a = make_billed_org(name="On demand", created_at=start, tax_rate="0.10")
    plan_services.credit_grant_create(organization=a, kind="promotional", amount="1.00",
                                      granted_at=start)
    client_a = _client(live_gateway, a)
    sent_a = [_send(client_a), _send(client_a),  # the repeat reads the prompt from cache
              _send(client_a, content="Name three rivers.", tier="priority"),
              _send(client_a, content="Name three lakes.", tier="flex", max_tokens=90)]
    assert sent_a[1].cached > 0 and sent_a[1].region == sent_a[0].region
    assert [s.tier for s in sent_a] == ["default", "default", "priority", "flex"]

    # R: one reserved unit of `small` in us-east (1,000 tokens/min), spilling over
    r = make_billed_org(name="Reserved", created_at=start)
    plan_services.reservation_create(
        organization=r, units=1, term="monthly", starts_at=start, overflow_policy="spillover",
        offering=make_offering(model="small", region="us-east", output_burndown="1",
                               tokens_per_minute_per_unit=1000))
    client_r = _client(live_gateway, r)
    sent_r = []
    while not sent_r or sent_r[-1].source != "spillover":
        sent_r.append(_send(client_r, content="Count to fifty.", max_tokens=300))
        assert len(sent_r) <= 12, "the reservation never spilled over"
    assert {s.source for s in sent_r[:-1]} == {"provisioned"}

    # P: a token plan of 600 credits (1 credit per token), overage at on-demand prices
    p = make_billed_org(name="Plan", created_at=start)
    plan = make_token_plan(credits_per_period="600", window_credits=None, cap_policy="overage",
                           coefficients=[{"model": "small", "token_class": c, "coefficient": "1"}
                                         for c in PRICES])
    plan_services.subscription_create(organization=p, plan=plan, starts_at=start)
    client_p = _client(live_gateway, p)
    sent_p = [_send(client_p, content=f"Plan request {i}.", max_tokens=150) for i in range(6)]
    _ingested(sent_a + sent_r + sent_p)

    # when the month closes
    report = services.period_close_run(now=end + timedelta(hours=1), enqueue_payments=False,
                                       org_ids=[a.id, r.id, p.id])
    assert report.invoices == 3

    # then A: a line per tier x region x token class, each the hand computation rounded once
    inv_a = Invoice.objects.get(organization=a, period_start=start)
    assert (inv_a.period_end, inv_a.status) == (end, InvoiceStatus.OPEN)
    assert _usage_lines(inv_a) == _as_lines(_expected(sent_a))
    subtotal = sum(cents(amount) for _, amount in _expected(sent_a).values())
    assert inv_a.subtotal == subtotal > Decimal("1.00")
    # the promotional credit is a discount: tax is on the subtotal less it
    assert inv_a.tax == cents((subtotal - Decimal("1.00")) * Decimal("0.10"))
    assert inv_a.credits_applied == Decimal("1.00")
    assert inv_a.total == subtotal + inv_a.tax - Decimal("1.00")
    assert inv_a.total == sum(ln.amount for ln in inv_a.lines.all())

    # R: provisioned requests listed at no per-token charge, the spillover at on-demand; the
    # unit's monthly fee
    inv_r = Invoice.objects.get(organization=r, period_start=start)
    assert _usage_lines(inv_r) == _as_lines(_expected(sent_r, free=frozenset({"provisioned"})))
    (fee,) = inv_r.lines.filter(kind=LineKind.RESERVATION_FEE)
    assert fee.amount == Decimal("100.00")
    assert inv_r.total == Decimal("100.00") + sum(
        cents(a) for _, a in _expected(sent_r, free=frozenset({"provisioned"})).values())

    # P: requests inside the 600 credits at 0; the one that crosses the cap bills the share
    # past it at on-demand prices, the ones after it in full; the plan's fee
    used, fractions, sources = Decimal(0), {}, []
    for s in sent_p:
        credits = Decimal(s.prompt + s.out)
        over = min(credits, max(Decimal(0), used + credits - 600))
        used += credits
        fractions[s.request_id] = over / credits
        sources.append("overage" if over else "plan")
    assert "plan" in sources and "overage" in sources
    assert any(0 < f < 1 for f in fractions.values()), "no request crossed the cap"
    rated = [Sent(s.request_id, s.tier, s.region, src, s.prompt, s.cached, s.out)
             for s, src in zip(sent_p, sources, strict=True)]
    inv_p = Invoice.objects.get(organization=p, period_start=start)
    assert _usage_lines(inv_p) == _as_lines(_expected(rated, fractions, free=frozenset({"plan"})))
    (plan_fee,) = inv_p.lines.filter(kind=LineKind.PLAN_FEE)
    assert plan_fee.amount == Decimal("10.00")

    # and a second close creates nothing
    again = services.period_close_run(now=end + timedelta(hours=2), enqueue_payments=False,
                                      org_ids=[a.id, r.id, p.id])
    assert again.invoices == 0

    # when a request of A arrives for the month already invoiced (its event is "late")
    late = _send(client_a, content="One more question.", max_tokens=25)
    _ingested([late])
    services.period_close_run(now=add_months(end, 1) + timedelta(hours=1),
                              enqueue_payments=False, org_ids=[a.id])

    # then the next invoice bills it as late usage from that month, and the first is unchanged
    following = Invoice.objects.get(organization=a, period_start=end)
    assert _usage_lines(following, LineKind.LATE_USAGE) == _as_lines(_expected([late]))
    assert all(ln.description.startswith(f"Late usage from {start:%Y-%m-%d}")
               for ln in following.lines.filter(kind=LineKind.LATE_USAGE))
    inv_a.refresh_from_db()
    assert _usage_lines(inv_a) == _as_lines(_expected(sent_a))
