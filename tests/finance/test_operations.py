"""Finance operations on invoices through ``/api/v1/finance/``, as a controller runs them.

Each operation's effect, its audit row (who, why, before and after), its idempotent replay
(the same Idempotency-Key answers the first result and does nothing again) and its refusals
(409/400 with nothing written). Stripe is the stand-in, spoken to with the official library;
invoices are made by period close. Every test ends with the billing invariant.
"""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from billing_platform.invoicing import services, stripe_client
from billing_platform.invoicing.choices import CreditOutcome, InvoiceStatus, RefundStatus
from billing_platform.invoicing.models import Invoice, InvoiceLine, PaymentAttempt, Refund
from plans.models import CreditGrant
from tests.finance.operations_setup import (
    NewRows,
    pay_through_stripe,
    post,
    price_book,
    reserved_invoice,
    set_default_card,
)
from tests.invoicing.conftest import billing_invariant_holds  # noqa: F401 - autouse check
from tests.invoicing.test_invoice_payments import WEBHOOK_URL, _event, _signed

D = Decimal


@pytest.fixture
def invoice(db, stripe_settings):
    price_book()
    return reserved_invoice("Open Co")


@pytest.fixture
def taxed(db, stripe_settings):
    """An open invoice of 200.00 + 10 % tax = 220.00."""
    price_book()
    invoice = reserved_invoice("Taxed Co", tax_rate="0.10")
    assert (invoice.subtotal, invoice.tax, invoice.total) == (D("200.00"), D("20.00"),
                                                              D("220.00"))
    return invoice


def test_void_an_open_invoice_once_and_its_replay_changes_nothing(controller_client, invoice,
                                                                  finance_controller):
    rows = NewRows()
    first = post(controller_client, f"invoices/{invoice.public_id}/void/",
                 {"reason": "billed in error"}, key="void-1")
    assert first.status_code == 200, first.content
    assert (first.json()["id"], first.json()["status"]) == (invoice.public_id, "void")
    invoice.refresh_from_db()
    assert invoice.status == InvoiceStatus.VOID and invoice.memo == "billed in error"
    (row,) = rows("invoice.void")
    assert (row.actor_user_id, row.target) == (finance_controller.id, invoice.public_id)
    assert (row.before["status"], row.after["status"], row.after["reason"]) == (
        "open", "void", "billed in error")

    # the same key again: the first answer, marked replayed, and no second row
    again = post(controller_client, f"invoices/{invoice.public_id}/void/",
                 {"reason": "billed in error"}, key="void-1")
    assert again.status_code == 200 and again.json() == first.json()
    assert again.headers["Idempotent-Replayed"] == "true"
    assert len(rows("invoice.void")) == 1

    # a new key: the invoice is void already, refused, nothing written
    refused = post(controller_client, f"invoices/{invoice.public_id}/void/", {"reason": "x"})
    assert refused.status_code == 409 and "void" in refused.json()["detail"]
    assert len(rows()) == 1


def test_a_paid_invoice_is_not_voided(controller_client, invoice):
    services.invoice_mark_paid(invoice=invoice, reference="TRX-1", acting_user=None)
    rows = NewRows()
    response = post(controller_client, f"invoices/{invoice.public_id}/void/", {"reason": "x"})
    assert response.status_code == 409
    assert response.json() == {"detail": "A paid invoice cannot be voided.", "code": "conflict",
                               "param": "status"}
    invoice.refresh_from_db()
    assert invoice.status == InvoiceStatus.PAID and rows() == []


def test_credit_notes_on_an_open_invoice_reduce_what_is_due(controller_client, taxed,
                                                            finance_controller):
    url = f"invoices/{taxed.public_id}/credit-notes/"
    rows = NewRows()

    # by lines: 50.00 of the reservation fee (line 1), with its 10 % tax
    by_line = post(controller_client, url, {"reason": "outage", "lines": [
        {"line": 1, "amount": "50.00"}]}, key="cn-1")
    assert by_line.status_code == 201, by_line.content
    note = by_line.json()["credit_note"]
    assert (note["total"], note["subtotal"], note["tax"]) == ("-55.0000", "-50.0000",
                                                             "-5.0000")
    assert [(ln["kind"], ln["amount"]) for ln in note["lines"]] == [
        ("reservation_fee", "-50.0000"), ("tax", "-5.0000")]
    assert by_line.json()["invoice"]["amount_due"] == "165.0000"
    assert by_line.json()["refund"] is None
    taxed.refresh_from_db()
    assert (taxed.status, taxed.amount_due, taxed.total) == (InvoiceStatus.OPEN, D("165.00"),
                                                             D("220.00"))
    assert not CreditGrant.objects.filter(organization=taxed.organization).exists()
    (row,) = rows("credit_note.create")
    assert (row.actor_user_id, row.target) == (finance_controller.id, note["id"])
    assert (row.before["amount_due"], row.after["amount_due"]) == ("220.00", "165.00")
    assert (row.after["reason"], row.after["outcome"], row.after["lines"]) == (
        "outage", "amount_due", ["1"])

    # replayed: the same note, no second one
    again = post(controller_client, url, {"reason": "outage", "lines": [
        {"line": 1, "amount": "50.00"}]}, key="cn-1")
    assert again.json() == by_line.json()
    assert Invoice.objects.filter(corrects=taxed).count() == 1

    # the line has 150.00 left: 150.01 of it is refused, nothing written
    beyond = post(controller_client, url, {"reason": "x", "lines": [
        {"line": 1, "amount": "150.01"}]})
    assert beyond.status_code == 400 and "150.00 USD left" in beyond.json()["detail"]
    # the invoice has 165.00 left: an amount of 165.01 is refused
    too_much = post(controller_client, url, {"reason": "x", "amount": "165.01"})
    assert too_much.status_code == 400
    assert "remains creditable" in too_much.json()["detail"]
    assert too_much.json()["param"] == "amount"
    assert Invoice.objects.filter(corrects=taxed).count() == 1 and len(rows()) == 1

    # the rest by amount: nothing is left to pay, the invoice is settled
    rest = post(controller_client, url, {"reason": "waived", "amount": "165.00"})
    assert rest.status_code == 201
    taxed.refresh_from_db()
    assert (taxed.status, taxed.amount_due) == (InvoiceStatus.PAID, D("0"))
    assert sum(n.total for n in taxed.credit_notes.all()) == -taxed.total


@pytest.mark.parametrize("body", [
    {"reason": "x", "amount": "abc"}, {"reason": "x", "amount": "-5"},
    {"reason": "x", "amount": "0"}, {"reason": "x", "amount": "1.001"},
    {"reason": "x", "amount": "NaN"}, {"reason": "x", "amount": "1e30"},
    {"reason": "x"}, {"amount": "1.00"}, {"reason": "", "amount": "1.00"},
    {"reason": "x", "amount": "1.00", "lines": [{"line": 1}]},
    {"reason": "x", "lines": []}, {"reason": "x", "lines": [{"line": 99}]},
    {"reason": "x", "lines": [{"line": 2}]},  # the tax line is not a charge to credit
    {"reason": "x", "lines": [{"line": 1}, {"line": 1}]},
    {"reason": "x", "lines": [{"line": "one"}]}, {"reason": "x", "lines": "all"},
    {"reason": "x", "amount": "1.00", "outcome": "refund"},  # an unpaid invoice's: amount due
    {"reason": "x" * 501, "amount": "1.00"},
])
def test_malformed_credit_notes_are_refused_with_nothing_written(controller_client, taxed,
                                                                 body):
    rows = NewRows()
    response = post(controller_client, f"invoices/{taxed.public_id}/credit-notes/", body)
    assert response.status_code == 400, response.content
    taxed.refresh_from_db()
    assert taxed.amount_due == D("220.00") and rows() == []
    assert not Invoice.objects.filter(corrects=taxed).exists()


def test_a_note_on_an_invoice_being_charged_waits_for_the_charge(controller_client, invoice):
    set_default_card(invoice.organization)
    services._charge_attempt_begin(invoice_id=invoice.id, now=timezone.now())  # sent, unanswered
    response = post(controller_client, f"invoices/{invoice.public_id}/credit-notes/",
                    {"reason": "x", "amount": "10.00"})
    assert response.status_code == 409 and "in progress" in response.json()["detail"]
    invoice.refresh_from_db()
    assert invoice.amount_due == D("200.00")


def test_a_paid_invoice_credit_is_finances_choice_refund_or_balance(controller_client,
                                                                    invoice,
                                                                    django_capture_on_commit_callbacks):
    pay_through_stripe(invoice)
    url = f"invoices/{invoice.public_id}/credit-notes/"

    # no choice made: refused
    unchosen = post(controller_client, url, {"reason": "x", "amount": "10.00"})
    assert unchosen.status_code == 400 and "outcome" in unchosen.json()

    # a credit balance: a credit grant of the amount, the invoice untouched
    balance = post(controller_client, url, {"reason": "goodwill", "amount": "30.00",
                                            "outcome": "credit_balance"})
    assert balance.status_code == 201, balance.content
    grant = CreditGrant.objects.get(organization=invoice.organization)
    assert (grant.kind, grant.amount, grant.remaining) == ("credit_note", D("30.00"),
                                                           D("30.00"))

    # a refund: committed pending with the note, sent after commit (a task)
    with django_capture_on_commit_callbacks() as enqueued:
        refund = post(controller_client, url, {"reason": "overcharged", "amount": "50.00",
                                               "outcome": "refund"})
    assert refund.status_code == 201, refund.content
    assert len(enqueued) == 1
    note = Invoice.objects.get(public_id=refund.json()["credit_note"]["id"])
    assert note.credit_outcome == CreditOutcome.REFUND
    (pending,) = Refund.objects.all()
    assert (pending.status, pending.amount, pending.idempotency_key) == (
        RefundStatus.PENDING, D("50.00"), f"credit_note:{note.id}:refund")
    assert refund.json()["refund"]["status"] == "pending"

    # what remains creditable is 200 - 30 - 50 = 120.00; of the payment, 150.00 to refund
    over = post(controller_client, url, {"reason": "x", "amount": "120.01",
                                         "outcome": "credit_balance"})
    assert over.status_code == 400 and "120.00 USD" in over.json()["detail"]
    invoice.refresh_from_db()
    assert (invoice.status, invoice.amount_due, invoice.amount_paid) == (
        InvoiceStatus.PAID, D("200.00"), D("200.00"))


def test_a_refund_is_refused_for_an_invoice_paid_outside_stripe(controller_client, invoice):
    services.invoice_mark_paid(invoice=invoice, reference="TRX-9", acting_user=None)
    rows = NewRows()
    response = post(controller_client, f"invoices/{invoice.public_id}/credit-notes/",
                    {"reason": "x", "amount": "10.00", "outcome": "refund"})
    assert response.status_code == 409
    assert "not paid through Stripe" in response.json()["detail"]
    assert rows() == [] and not Invoice.objects.filter(corrects=invoice).exists()


def test_refund_send_refunds_once_through_stripe(invoice, controller_client,
                                                 django_capture_on_commit_callbacks):
    # given a paid invoice and a refund note on it (its task not run yet)
    pay_through_stripe(invoice)
    with django_capture_on_commit_callbacks():
        post(controller_client, f"invoices/{invoice.public_id}/credit-notes/",
             {"reason": "overcharged", "amount": "75.00", "outcome": "refund"})
    (refund,) = Refund.objects.all()
    rows = NewRows()

    # when the task runs twice
    assert services.refund_send(refund_id=refund.id) == "succeeded"
    assert services.refund_send(refund_id=refund.id) == "succeeded"

    # then Stripe refunded 75.00 once, to the invoice's payment
    refund.refresh_from_db()
    attempt = PaymentAttempt.objects.get(invoice=invoice)
    found = stripe_client.client().v1.refunds.list(
        {"payment_intent": attempt.stripe_payment_intent_id}).data
    assert [(r.id, r.amount, r.metadata["credit_note"]) for r in found] == [
        (refund.stripe_refund_id, 7500, refund.credit_note.public_id)]
    (row,) = rows("credit_note.refund")
    assert (row.after["status"], row.after["amount"], row.actor_label) == (
        "succeeded", "75.00", "system")


def test_a_refund_stripe_refuses_is_left_failed_for_finance(invoice, controller_client,
                                                            django_capture_on_commit_callbacks):
    # given a paid invoice of which 100.00 was refunded in Stripe's dashboard (no webhook yet)
    pay_through_stripe(invoice)
    intent = PaymentAttempt.objects.get(invoice=invoice).stripe_payment_intent_id
    stripe_client.client().v1.refunds.create({"payment_intent": intent, "amount": 10000})
    with django_capture_on_commit_callbacks():
        note = post(controller_client, f"invoices/{invoice.public_id}/credit-notes/",
                    {"reason": "overcharged", "amount": "150.00", "outcome": "refund"})
    assert note.status_code == 201, note.content  # our books knew of no refund yet
    (refund,) = Refund.objects.all()
    rows = NewRows()

    # when the task sends it, Stripe refuses (only 100.00 is left of the charge)
    assert services.refund_send(refund_id=refund.id) == "failed"

    # then it is failed with Stripe's reason, audited, sent no more, and nothing else moved
    refund.refresh_from_db()
    assert refund.status == RefundStatus.FAILED and refund.failure_message
    assert refund.stripe_refund_id == ""
    (row,) = rows("credit_note.refund")
    assert (row.after["status"], row.after["failure"]) == ("failed", refund.failure_message)
    assert services.refund_send(refund_id=refund.id) == "failed"
    found = stripe_client.client().v1.refunds.list({"payment_intent": intent}).data
    assert [r.amount for r in found] == [10000]


def test_mark_paid_offline_keeps_the_reference(controller_client, invoice, finance_controller):
    url = f"invoices/{invoice.public_id}/mark-paid/"
    assert post(controller_client, url, {"reason": "wire"}).status_code == 400  # no reference
    rows = NewRows()
    paid = post(controller_client, url, {"reason": "wire received", "reference": "BANK-42"},
                key="paid-1")
    assert paid.status_code == 200, paid.content
    assert (paid.json()["status"], paid.json()["payment_reference"]) == ("paid", "BANK-42")
    (row,) = rows("invoice.mark_paid")
    assert row.actor_user_id == finance_controller.id
    assert (row.after["reference"], row.after["reason"], row.after["amount_paid"]) == (
        "BANK-42", "wire received", "200.00")
    again = post(controller_client, url, {"reason": "wire received", "reference": "BANK-42"},
                 key="paid-1")
    assert again.json() == paid.json() and len(rows()) == 1
    # the same key with other values is refused
    other = post(controller_client, url, {"reason": "wire", "reference": "BANK-43"},
                 key="paid-1")
    assert other.status_code == 400 and "same parameters" in other.json()["detail"]
    invoice.refresh_from_db()
    assert invoice.payment_reference == "BANK-42"


def test_pause_and_resume_dunning(controller_client, invoice, finance_controller, client):
    # given a declined charge: dunning retries in a day
    customer_id = set_default_card(invoice.organization, "pm_card_chargeCustomerFail")
    assert services.invoice_charge(invoice_id=invoice.id) == "failed"
    invoice.refresh_from_db()
    retry_at = invoice.next_payment_attempt_at
    rows = NewRows()

    paused = post(controller_client, f"invoices/{invoice.public_id}/dunning/pause/",
                  {"reason": "customer disputes the invoice"})
    assert paused.status_code == 200 and paused.json()["dunning_paused_at"]
    assert services.invoices_dunning_run(now=retry_at + timedelta(days=30)) == []
    # a card added meanwhile (Stripe's customer.updated) does not retry a held invoice either
    customer = stripe_client.client().v1.customers.retrieve(customer_id).to_dict()
    body = _event("evt_customer_paused", "customer.updated", customer)
    answer = client.post(WEBHOOK_URL, body, content_type="application/json",
                         HTTP_STRIPE_SIGNATURE=_signed(body))
    assert (answer.status_code, answer.content) == (200, b"retrying 0 open invoice(s)")
    invoice.refresh_from_db()
    assert invoice.next_payment_attempt_at == retry_at
    again = post(controller_client, f"invoices/{invoice.public_id}/dunning/pause/",
                 {"reason": "x"})
    assert again.status_code == 409

    resumed = post(controller_client, f"invoices/{invoice.public_id}/dunning/resume/",
                   {"reason": "settled with the customer"})
    assert resumed.status_code == 200 and resumed.json()["dunning_paused_at"] is None
    assert services.invoices_dunning_run(now=retry_at) == [invoice.id]
    assert [(r.action, r.actor_user_id, r.after["reason"]) for r in rows()] == [
        ("invoice.dunning_pause", finance_controller.id, "customer disputes the invoice"),
        ("invoice.dunning_resume", finance_controller.id, "settled with the customer")]
    assert rows()[0].before["dunning_paused_at"] == "" and rows()[0].after["dunning_paused_at"]


def test_retry_charge_now_needs_a_card_and_charges_once(controller_client, invoice,
                                                        django_capture_on_commit_callbacks):
    url = f"invoices/{invoice.public_id}/retry-charge/"
    refused = post(controller_client, url, {"reason": "customer asked"})
    assert refused.status_code == 409 and "payment method" in refused.json()["detail"]

    set_default_card(invoice.organization)
    rows = NewRows()
    with django_capture_on_commit_callbacks() as enqueued:
        accepted = post(controller_client, url, {"reason": "customer asked"})
    assert accepted.status_code == 202, accepted.content
    assert len(enqueued) == 1  # the charge task, after commit
    (row,) = rows("invoice.retry_charge")
    assert (row.after["reason"], row.after["attempt"]) == ("customer asked", "1")
    # what the task does: one charge; a second retry while it is in flight is refused
    assert services.invoice_charge(invoice_id=invoice.id) == "succeeded"
    in_flight = post(controller_client, url, {"reason": "again"})
    assert in_flight.status_code == 409 and "succeeded" in in_flight.json()["detail"]


def test_write_off(controller_client, invoice, finance_controller):
    rows = NewRows()
    response = post(controller_client, f"invoices/{invoice.public_id}/write-off/",
                    {"reason": "customer insolvent"})
    assert response.status_code == 200, response.content
    invoice.refresh_from_db()
    assert invoice.status == InvoiceStatus.UNCOLLECTIBLE and invoice.written_off_at
    assert invoice.next_payment_attempt_at is None
    (row,) = rows("invoice.write_off")
    assert (row.actor_user_id, row.before["status"], row.after["status"]) == (
        finance_controller.id, "open", "uncollectible")
    assert row.after["reason"] == "customer insolvent"
    # written off once; money arriving later still settles it
    assert post(controller_client, f"invoices/{invoice.public_id}/write-off/",
                {"reason": "x"}).status_code == 409
    services.invoice_mark_paid(invoice=invoice, reference="late wire", acting_user=None)
    invoice.refresh_from_db()
    assert invoice.status == InvoiceStatus.PAID


def test_credit_lines_of_an_earlier_note_count_against_the_line(controller_client, taxed):
    url = f"invoices/{taxed.public_id}/credit-notes/"
    assert post(controller_client, url, {"reason": "a", "lines": [
        {"line": 1, "amount": "120.00"}]}).status_code == 201
    # all that is left of line 1 (80.00, plus its tax)
    rest = post(controller_client, url, {"reason": "b", "lines": [{"line": 1}]})
    assert rest.status_code == 201
    assert rest.json()["credit_note"]["total"] == "-88.0000"
    credited = InvoiceLine.objects.filter(corrects_line__invoice=taxed)
    assert sum(ln.amount for ln in credited) == D("-200.00")
    taxed.refresh_from_db()
    assert (taxed.status, taxed.amount_due) == (InvoiceStatus.PAID, D("0"))
    nothing = post(controller_client, url, {"reason": "c", "lines": [{"line": 1}],
                                            "outcome": "credit_balance"})
    assert nothing.status_code == 400 and "0.00 USD left" in nothing.json()["detail"]
