"""Finance operations on accounts through ``/api/v1/finance/``: close periods now after a
preview, one-off items for the next invoice, credit grants; and who may not operate.

The preview runs the close itself and rolls it back: its invoices are checked equal, figure by
figure, to the invoices the close then creates, and nothing of it persists (no invoice, no
audit row, no credit taken, no item billed). Dates are the real clock's: orgs exist since the
start of last month (one ended period) or the month before (two).
"""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from billing_platform.accounts.choices import Role
from billing_platform.audit.models import AuditEvent
from billing_platform.invoicing import services
from billing_platform.invoicing.choices import InvoiceStatus, LineKind
from billing_platform.invoicing.models import Invoice, PendingInvoiceItem
from plans import services as plan_services
from plans.models import CreditGrant
from tests.factories import MembershipFactory, make_billed_org, make_key
from tests.finance.operations_setup import (
    API,
    NewRows,
    last_month_start,
    post,
    price_book,
    reserved_invoice,
)
from tests.invoicing.conftest import billing_invariant_holds, record  # noqa: F401

D = Decimal


def _figures(invoice: dict) -> dict:
    """An invoice of the close's answer without what only the close has (id, number)."""
    return {k: v for k, v in invoice.items() if k not in ("id", "number")}


@pytest.fixture
def due(db):
    """Three orgs with ended periods: one with usage, tax, a credit grant and a one-off item;
    one two periods behind; one with nothing used."""
    price_book()
    start = last_month_start()
    before = (start - timedelta(days=1)).replace(day=1)
    taxed = make_billed_org(name="Taxed", created_at=start, tax_rate="0.20")
    behind = make_billed_org(name="Behind", created_at=before)
    idle = make_billed_org(name="Idle", created_at=start)
    record(taxed, "close-t1", start + timedelta(days=2), prompt_tokens=3_000_000,
           completion_tokens=1_000_000)
    record(behind, "close-b1", before + timedelta(days=3), prompt_tokens=1_000_000)
    record(behind, "close-b2", start + timedelta(days=3), prompt_tokens=2_000_000)
    # a credit balance (a credit note's): paid after tax, so the tax is 20 % of all of 255.00
    plan_services.credit_grant_create(organization=taxed, kind="credit_note", amount="1.50",
                                      granted_at=start)
    services.invoice_item_create(organization=taxed, description="Onboarding fee",
                                 amount=D("250.00"), reason="signed up", acting_user=None)
    return taxed, behind, idle


def test_the_preview_is_what_the_close_creates_and_persists_nothing(
        controller_client, finance_controller, due):
    taxed, behind, idle = due
    rows = NewRows()

    # when finance previews the close of every org that is due
    preview = post(controller_client, "periods/close/", {"dry_run": True})

    # then it shows four invoices (Behind's two periods in order) and creates nothing
    assert preview.status_code == 200, preview.content
    shown = preview.json()
    assert shown["dry_run"] is True
    assert [(i["organization"], i["status"]) for i in shown["invoices"]] == [
        (taxed.public_id, "open"), (behind.public_id, "open"), (behind.public_id, "open"),
        (idle.public_id, "paid")]
    taxed_shown = shown["invoices"][0]
    # 5.00 usage (3.00 input, 2.00 output), 250 onboarding; tax 20 % of 255; 1.50 credit
    assert (taxed_shown["subtotal"], taxed_shown["tax"], taxed_shown["credits_applied"],
            taxed_shown["total"]) == ("255.0000", "51.0000", "1.5000", "304.5000")
    assert shown["totals"] == {"USD": "307.5000"}  # 304.50 + 1.00 + 2.00 + 0
    assert all(i["id"] is None and i["number"] is None for i in shown["invoices"])
    assert not Invoice.objects.exists() and rows() == []
    assert CreditGrant.objects.get(organization=taxed).remaining == D("1.50")
    assert PendingInvoiceItem.objects.get(organization=taxed).invoice is None

    # when finance closes
    closed = post(controller_client, "periods/close/", {"reason": "month end"}, key="close-1")

    # then the invoices are the preview's, figure by figure
    assert closed.status_code == 200, closed.content
    made = closed.json()["invoices"]
    assert [_figures(i) for i in made] == [_figures(i) for i in shown["invoices"]]
    assert closed.json()["totals"] == shown["totals"]
    invoices = Invoice.objects.order_by("organization_id", "period_start")
    assert [i.public_id for i in invoices] == [i["id"] for i in made]
    assert [i.number for i in invoices] == [i["number"] for i in made]
    taxed_invoice = invoices[0]
    assert [ln.kind for ln in taxed_invoice.lines.all()] == [
        LineKind.USAGE, LineKind.USAGE, LineKind.ONE_OFF, LineKind.TAX, LineKind.CREDIT]
    assert PendingInvoiceItem.objects.get(organization=taxed).invoice == taxed_invoice
    assert CreditGrant.objects.get(organization=taxed).remaining == 0

    # audited: each invoice finalized by the controller, and the close with its reason
    assert {r.target for r in rows("invoice.finalize")} == {i.public_id for i in invoices}
    assert {r.actor_user_id for r in rows("invoice.finalize")} == {finance_controller.id}
    (close_row,) = rows("period.close")
    assert (close_row.actor_user_id, close_row.after["reason"], close_row.after["invoices"]) == (
        finance_controller.id, "month end", 4)

    # replayed: the first answer, nothing closed again; a new close finds nothing due
    again = post(controller_client, "periods/close/", {"reason": "month end"}, key="close-1")
    assert again.json() == closed.json() and again.headers["Idempotent-Replayed"] == "true"
    assert post(controller_client, "periods/close/",
                {"reason": "again"}).json()["invoices"] == []
    assert Invoice.objects.count() == 4
    assert len(rows("period.close")) == 2


def test_close_one_organization_with_its_lines(controller_client, due):
    _, behind, _ = due
    preview = post(controller_client, "periods/close/",
                   {"dry_run": True, "organization": behind.public_id})
    assert [i["period_start"] for i in preview.json()["invoices"]] == sorted(
        i["period_start"] for i in preview.json()["invoices"])
    assert [[ln["amount"] for ln in i["lines"]] for i in preview.json()["invoices"]] == [
        ["1.0000"], ["2.0000"]]
    closed = post(controller_client, "periods/close/",
                  {"reason": "early close", "organization": behind.public_id})
    assert [_figures(i) for i in closed.json()["invoices"]] == [
        _figures(i) for i in preview.json()["invoices"]]
    assert set(Invoice.objects.values_list("organization_id", flat=True)) == {behind.id}
    # a close needs a reason; an unknown organization is a 404
    assert post(controller_client, "periods/close/", {}).status_code == 400
    assert post(controller_client, "periods/close/",
                {"reason": "x", "organization": "org_forged"}).status_code == 404


def test_a_one_off_item_is_billed_once_and_a_void_does_not_release_it(controller_client,
                                                                      finance_controller):
    price_book()
    org = make_billed_org(name="Onboarded", created_at=last_month_start())
    url = f"organizations/{org.public_id}/invoice-items/"
    rows = NewRows()
    added = post(controller_client, url, {"reason": "contract §4", "amount": "500.00",
                                          "description": "Onboarding fee"}, key="item-1")
    assert added.status_code == 201, added.content
    assert (added.json()["amount"], added.json()["currency"], added.json()["invoice"]) == (
        "500.0000", "USD", None)
    (row,) = rows("invoice_item.create")
    assert (row.actor_user_id, row.after["reason"], row.after["amount"]) == (
        finance_controller.id, "contract §4", "500.00")
    assert post(controller_client, url, {"reason": "contract §4", "amount": "500.00",
                                         "description": "Onboarding fee"},
                key="item-1").json() == added.json()
    assert PendingInvoiceItem.objects.count() == 1

    # the upcoming invoice shows it; the close bills it once; a second close does not
    upcoming = services.upcoming_invoice(organization=org)
    assert [(ln.kind, ln.amount) for ln in upcoming.lines] == [(LineKind.ONE_OFF, D("500.00"))]
    post(controller_client, "periods/close/", {"reason": "month end"})
    invoice = Invoice.objects.get(organization=org)
    assert (invoice.total, invoice.status) == (D("500.00"), InvoiceStatus.OPEN)
    services.invoice_void(invoice=invoice, reason="fee waived", acting_user=None)
    assert PendingInvoiceItem.objects.get().invoice == invoice  # not released by the void
    assert services.upcoming_invoice(organization=org).lines == []


@pytest.mark.parametrize("body", [
    {"reason": "x", "description": "Fee", "amount": "0"},
    {"reason": "x", "description": "Fee", "amount": "-10.00"},
    {"reason": "x", "description": "Fee", "amount": "10.001"},
    {"reason": "x", "description": "Fee", "amount": "ten"},
    {"reason": "x", "description": "Fee", "amount": "99999999999999999"},
    {"reason": "x", "description": "", "amount": "10.00"},
    {"reason": "x", "description": "   ", "amount": "10.00"},
    {"reason": "x", "description": "F" * 301, "amount": "10.00"},
    {"description": "Fee", "amount": "10.00"},
])
def test_malformed_items_are_refused(controller_client, db, body):
    org = make_billed_org(name="Item Co")
    rows = NewRows()
    response = post(controller_client, f"organizations/{org.public_id}/invoice-items/", body)
    assert response.status_code == 400, response.content
    assert not PendingInvoiceItem.objects.exists() and rows() == []


def test_grant_promotional_and_goodwill_credit_with_expiry(controller_client,
                                                           finance_controller, db):
    org = make_billed_org(name="Granted")
    url = f"organizations/{org.public_id}/credit-grants/"
    expires = (timezone.now() + timedelta(days=90)).replace(microsecond=0)
    rows = NewRows()
    granted = post(controller_client, url, {"reason": "outage on the 3rd", "kind": "goodwill",
                                            "amount": "25.00",
                                            "expires_at": expires.isoformat()}, key="grant-1")
    assert granted.status_code == 201, granted.content
    grant = CreditGrant.objects.get(public_id=granted.json()["id"])
    assert (grant.kind, grant.amount, grant.currency, grant.expires_at, grant.note) == (
        "goodwill", D("25.00"), "USD", expires, "outage on the 3rd")
    assert grant.created_by == finance_controller
    (row,) = rows("credit_grant.create")
    assert (row.actor_user_id, row.after["note"]) == (finance_controller.id, "outage on the 3rd")
    again = post(controller_client, url, {"reason": "outage on the 3rd", "kind": "goodwill",
                                          "amount": "25.00", "expires_at": expires.isoformat()},
                 key="grant-1")
    assert again.json() == granted.json() and CreditGrant.objects.count() == 1

    promo = post(controller_client, url, {"reason": "launch", "kind": "promotional",
                                          "amount": "10"})
    assert promo.status_code == 201 and promo.json()["expires_at"] is None


@pytest.mark.parametrize("body", [
    {"reason": "x", "kind": "purchased", "amount": "10"},  # not finance's to grant
    {"reason": "x", "kind": "credit_note", "amount": "10"},
    {"reason": "x", "kind": "goodwill", "amount": "0"},
    {"reason": "x", "kind": "goodwill", "amount": "-1"},
    {"reason": "x", "kind": "goodwill", "amount": "lots"},
    {"reason": "x", "kind": "goodwill", "amount": "10", "expires_at": "2001-01-01T00:00:00Z"},
    {"reason": "x", "kind": "goodwill", "amount": "10", "expires_at": "soon"},
    {"reason": "x", "kind": "goodwill", "amount": "10", "currency": "U$"},
    {"kind": "goodwill", "amount": "10"},
])
def test_malformed_grants_are_refused(controller_client, db, body):
    org = make_billed_org(name="Refused grant")
    rows = NewRows()
    response = post(controller_client, f"organizations/{org.public_id}/credit-grants/", body)
    assert response.status_code == 400, response.content
    assert not CreditGrant.objects.exists() and rows() == []


# --- who may not operate ---------------------------------------------------------------------

def _routes(invoice: Invoice, org) -> list[tuple[str, dict]]:
    inv, o = invoice.public_id, org.public_id
    return [
        ("periods/close/", {"reason": "x"}),
        ("periods/close/", {"dry_run": True}),
        (f"invoices/{inv}/void/", {"reason": "x"}),
        (f"invoices/{inv}/credit-notes/", {"reason": "x", "amount": "1.00"}),
        (f"invoices/{inv}/mark-paid/", {"reason": "x", "reference": "r"}),
        (f"invoices/{inv}/retry-charge/", {"reason": "x"}),
        (f"invoices/{inv}/dunning/pause/", {"reason": "x"}),
        (f"invoices/{inv}/dunning/resume/", {"reason": "x"}),
        (f"invoices/{inv}/write-off/", {"reason": "x"}),
        (f"organizations/{o}/credit-grants/", {"reason": "x", "kind": "goodwill",
                                               "amount": "5"}),
        (f"organizations/{o}/invoice-items/", {"reason": "x", "description": "Fee",
                                               "amount": "5.00"}),
    ]


@pytest.fixture
def target(db, stripe_settings):
    price_book()
    return reserved_invoice("Target Co")


def _nothing_changed(invoice: Invoice, audit_before: int) -> None:
    invoice.refresh_from_db()
    assert (invoice.status, invoice.amount_due, invoice.dunning_paused_at) == (
        InvoiceStatus.OPEN, D("200.00"), None)
    assert AuditEvent.objects.count() == audit_before
    assert not CreditGrant.objects.exists() and not PendingInvoiceItem.objects.exists()
    assert Invoice.objects.count() == 1


def test_an_analyst_org_members_keys_and_strangers_get_404(target, analyst_client):
    org = target.organization
    owner = MembershipFactory(organization=org, role=Role.OWNER).user
    org_finance = MembershipFactory(organization=org, role=Role.FINANCE).user
    _, secret = make_key(org.projects.first(), scopes=["admin"])
    clients = {"analyst": analyst_client, "anonymous": APIClient()}
    for name, user in (("owner", owner), ("org finance", org_finance)):
        clients[name] = APIClient()
        clients[name].force_authenticate(user)
    clients["api key"] = APIClient()
    clients["api key"].credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    audit_before = AuditEvent.objects.count()
    for name, client in clients.items():
        for path, body in _routes(target, org):
            response = post(client, path, body)
            assert response.status_code == 404, (name, path, response.content)
    _nothing_changed(target, audit_before)


def test_forged_and_wrong_kind_ids_are_404(controller_client, target):
    org = target.organization
    note = services.credit_note_create(invoice=target, amount=D("1.00"), reason="r",
                                       acting_user=None)
    draft = Invoice.objects.create(organization=make_billed_org(name="Drafty"), currency="USD",
                                   period_start=target.period_end,
                                   period_end=target.period_end + timedelta(days=30))
    for invoice_id in ("in_forged", note.public_id, draft.public_id, "", "../x"):
        for op in ("void", "write-off", "dunning/pause"):
            response = post(controller_client, f"invoices/{invoice_id}/{op}/", {"reason": "x"})
            assert response.status_code == 404, (invoice_id, op)
    for org_id in ("org_forged", target.public_id):
        response = post(controller_client, f"organizations/{org_id}/credit-grants/",
                        {"reason": "x", "kind": "goodwill", "amount": "1"})
        assert response.status_code == 404
    assert not CreditGrant.objects.filter(organization=org).exists()
    # GET is not an operation
    assert controller_client.get(f"{API}/invoices/{target.public_id}/void/").status_code == 405
