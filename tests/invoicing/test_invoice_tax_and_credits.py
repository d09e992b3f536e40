"""What is applied before tax and what after: discount credit lowers what is taxed, a credit
balance pays the taxed total; the upcoming preview and the closed invoice agree.

Promotional, goodwill and purchased credit are applied to the subtotal before tax (a discount;
a credit pack was taxed when it was bought). A credit note's balance is money already paid,
tax included, and is applied after tax, as a payment.
"""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

from billing_platform.invoicing import rendering, selectors, services
from billing_platform.invoicing.choices import LineKind
from billing_platform.invoicing.models import Invoice
from plans import services as plan_services
from plans.models import CreditGrant
from tests.factories import make_billed_org
from tests.invoicing.conftest import NOV, OCT, record

D = Decimal


def test_discount_credit_before_tax_and_a_credit_balance_after_it(catalog):
    # given 100.00 of October usage at 20 % tax, 10.00 promotional and 30.00 credit-note credit
    org = make_billed_org(name="Taxed", tax_rate="0.2000", created_at=OCT)
    record(org, "t1", OCT + timedelta(days=3), prompt_tokens=100_000_000)  # 1.00 per 1M
    for kind, amount in (("promotional", "10.00"), ("credit_note", "30.00")):
        plan_services.credit_grant_create(organization=org, kind=kind, amount=amount,
                                          granted_at=OCT)
    preview = selectors.upcoming_invoice(organization=org, now=OCT + timedelta(days=20))

    # when October closes
    services.period_close_run(now=NOV + timedelta(hours=1), enqueue_payments=False)

    # then tax is 20 % of 100.00 - 10.00, and the balance pays 30.00 of the taxed 108.00
    invoice = Invoice.objects.get(organization=org)
    lines = [(ln.kind, ln.amount, (ln.details or {}).get("applied"))
             for ln in invoice.lines.all()]
    assert lines == [(LineKind.USAGE, D("100.00"), None),
                     (LineKind.CREDIT, D("-10.00"), "before_tax"),
                     (LineKind.TAX, D("18.00"), None),
                     (LineKind.CREDIT, D("-30.00"), "after_tax")]
    assert (invoice.subtotal, invoice.tax, invoice.credits_applied, invoice.total) == (
        D("100.00"), D("18.00"), D("40.00"), D("78.00"))
    assert sorted(CreditGrant.objects.filter(organization=org).values_list(
        "kind", "remaining")) == [("credit_note", D("0")), ("promotional", D("0"))]
    # the preview said the same before the close
    assert (preview.subtotal, preview.tax, preview.credits_applied, preview.total) == (
        D("100.00"), D("18.00"), D("40.00"), D("78.00"))
    # and the document says which credit is which side of tax
    doc = rendering.document_of(invoice, org)
    assert (doc.credits_before_tax, doc.tax_label, doc.tax, doc.credits_after_tax) == (
        "10.00", "Tax 20 % on 90.00", "18.00", "30.00")


def test_a_credit_balance_larger_than_the_invoice_pays_it_in_full_and_keeps_the_rest(catalog):
    org = make_billed_org(name="Ahead", tax_rate="0.1000", created_at=OCT)
    record(org, "t2", OCT + timedelta(days=3), prompt_tokens=5_000_000)  # 5.00
    plan_services.credit_grant_create(organization=org, kind="credit_note", amount="20.00",
                                      granted_at=OCT)

    services.period_close_run(now=NOV + timedelta(hours=1), enqueue_payments=False)

    invoice = Invoice.objects.get(organization=org)
    assert (invoice.tax, invoice.credits_applied, invoice.total) == (D("0.50"), D("5.50"), 0)
    assert CreditGrant.objects.get(organization=org).remaining == D("14.50")
