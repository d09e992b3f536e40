"""The finance workspace's operations pages at ``/finance/``: invoices (find one, and on it:
void, credit note, mark paid, retry the charge, pause or resume dunning, write off), closing
periods now after a preview, and an organization's page (grant credits, add a one-off item).

Reading these pages needs ``finance.view_reports``; every form, and every POST, needs
``finance.operate`` too: an analyst sees no form, and a POST forged by one is a 404, as for
anyone else. Each operation is one call of its service (``invoicing.services``,
``plans.services``), which checks what the invoice allows and writes the audit row with the
actor and the reason. It runs once per form: the form's hidden key goes through
``idempotency.idempotent_call``, so a double submit or a re-posting reload does it once and
says so. A refused operation (a domain error) or a malformed field is a message on the form,
shown again with what was sent (400); nothing is half-written.
"""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from typing import Any, cast

from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from billing_platform.accounts.models import Organization, User
from billing_platform.console import finance_forms as ff
from billing_platform.console import once
from billing_platform.console.finance_views import finance_context, finance_page
from billing_platform.errors import DomainError, InvalidRequest
from billing_platform.invoicing import finance_reads
from billing_platform.invoicing import services as invoicing
from billing_platform.invoicing.choices import InvoiceKind, InvoiceStatus
from billing_platform.invoicing.models import Invoice
from billing_platform.invoicing.money import quantize_money
from plans import services as plan_services
from plans.selectors import credit_grants_of

STATUSES = [s.value for s in InvoiceStatus if s != InvoiceStatus.DRAFT]


def run_once(request: HttpRequest, form: ff.OperationForm, *, operation: str, target: str,
             call: Callable[[], str]) -> bool:
    """``once.run_once`` for an operation on ``target``, fingerprinted with the form's fields."""
    return once.run_once(request, form, operation=[operation, target, form.audited()],
                         call=call)


def _money(amount: Decimal, currency: str) -> str:
    return f"{quantize_money(amount, currency)} {currency}"


# --- invoices --------------------------------------------------------------------------------

@finance_page()
def invoices(request: HttpRequest) -> HttpResponse:
    """Find invoices of every organization by organization, status, kind or number."""
    wanted = {k: request.GET.get(k, "").strip()[:64] for k in ("organization", "status",
                                                                 "kind", "number")}
    errors = []
    if wanted["status"] and wanted["status"] not in STATUSES:
        errors.append(f"status: must be one of {', '.join(STATUSES)}.")
    if wanted["kind"] and wanted["kind"] not in InvoiceKind.values:
        errors.append(f"kind: must be one of {', '.join(InvoiceKind.values)}.")
    found = [] if errors else finance_reads.invoices_find(
        organization_public_id=wanted["organization"] or None,
        status=wanted["status"] or None, kind=wanted["kind"] or None,
        number=wanted["number"] or None)
    return render(request, "finance/invoices.html", finance_context(
        request, "invoices", invoices=found, wanted=wanted, errors=errors, statuses=STATUSES,
        kinds=InvoiceKind.values), status=400 if errors else 200)


def _invoice(public_id: str) -> Invoice:
    invoice = finance_reads.invoice_find(public_id=public_id)
    if invoice is None:
        raise Http404("No such invoice.")
    return invoice


def _positions(invoice: Invoice) -> list[tuple[int, str]]:
    """Return the lines a credit note may credit (charges, not tax or credits), labelled."""
    return [(ln.position,
             f"{ln.position}. {ln.description} ({_money(ln.amount, invoice.currency)})")
            for ln in invoice.lines.all() if ln.kind not in ("tax", "credit") and ln.amount > 0]


def _operation_form(invoice: Invoice, operation: str, data: Any = None) -> ff.OperationForm:
    """Return the form of one operation on the invoice (bound to ``data`` when given)."""
    if operation == "credit-note":
        return ff.CreditNoteForm(data, positions=_positions(invoice),
                                 paid=invoice.status == InvoiceStatus.PAID)
    return FORMS[operation](data)


def _invoice_forms(invoice: Invoice) -> dict[str, ff.OperationForm]:
    """Return the forms of the operations the invoice's status allows (the services decide
    in the end: a form sent anyway gets the service's refusal as its message)."""
    status = invoice.status
    is_invoice = invoice.kind == InvoiceKind.INVOICE
    unpaid = status in (InvoiceStatus.OPEN, InvoiceStatus.UNCOLLECTIBLE)
    names = []
    if is_invoice and unpaid:
        names += ["void", "mark-paid"]
        if invoice.written_off_at is None:
            names.append("write-off")
    if is_invoice and status == InvoiceStatus.OPEN:
        names += ["retry", "resume-dunning" if invoice.dunning_paused_at else "pause-dunning"]
    if is_invoice and (unpaid or status == InvoiceStatus.PAID):
        names.append("credit-note")
    return {name: _operation_form(invoice, name) for name in names}


def _invoice_page(request: HttpRequest, invoice: Invoice, forms: dict[str, ff.OperationForm],
                  status: int = 200) -> HttpResponse:
    context = finance_context(request, "invoices", invoice=invoice, lines=invoice.lines.all(),
                              notes=invoice.credit_notes.all(), payments=invoice.payments.all(),
                              refunds=invoice.refunds.all())
    context["forms"] = forms if context["can_operate"] else {}
    return render(request, "finance/invoice.html", context, status=status)


@finance_page()
def invoice(request: HttpRequest, public_id: str) -> HttpResponse:
    """One invoice: its lines, notes, payments and refunds; for a controller, its operations."""
    found = _invoice(public_id)
    return _invoice_page(request, found, _invoice_forms(found))


def _do_void(form: ff.OperationForm, invoice: Invoice, user: User) -> str:
    invoicing.invoice_void(invoice=invoice, reason=form.cleaned_data["reason"], acting_user=user)
    return f"Invoice {invoice.number} is void."


def _do_mark_paid(form: ff.OperationForm, invoice: Invoice, user: User) -> str:
    paid = invoicing.invoice_mark_paid(invoice=invoice, reference=form.cleaned_data["reference"],
                                       reason=form.cleaned_data["reason"], acting_user=user)
    return f"Invoice {paid.number} is marked paid ({form.cleaned_data['reference']})."


def _do_retry(form: ff.OperationForm, invoice: Invoice, user: User) -> str:
    invoicing.invoice_charge_retry(invoice=invoice, reason=form.cleaned_data["reason"],
                                   acting_user=user)
    return f"Invoice {invoice.number} will be charged now."


def _do_pause(form: ff.OperationForm, invoice: Invoice, user: User) -> str:
    invoicing.invoice_dunning_pause(invoice=invoice, reason=form.cleaned_data["reason"],
                                    acting_user=user)
    return f"Dunning of invoice {invoice.number} is paused."


def _do_resume(form: ff.OperationForm, invoice: Invoice, user: User) -> str:
    invoicing.invoice_dunning_resume(invoice=invoice, reason=form.cleaned_data["reason"],
                                     acting_user=user)
    return f"Dunning of invoice {invoice.number} is resumed."


def _do_write_off(form: ff.OperationForm, invoice: Invoice, user: User) -> str:
    invoicing.invoice_write_off(invoice=invoice, reason=form.cleaned_data["reason"],
                                acting_user=user)
    return f"Invoice {invoice.number} is written off as uncollectible."


def _do_credit_note(form: ff.OperationForm, invoice: Invoice, user: User) -> str:
    data = form.cleaned_data
    lines = ([invoicing.LineCredit(position=p) for p in data["lines"]]
             if data.get("lines") else None)
    note = invoicing.credit_note_create(
        invoice=invoice, amount=data.get("amount"), lines=lines, outcome=data.get("outcome"),
        reason=data["reason"], acting_user=user)
    outcome = {"refund": "refunded through Stripe", "credit_balance": "granted as credit",
               "amount_due": "taken off the amount due"}.get(str(note.credit_outcome), "")
    return (f"Credit note {note.number} for {_money(-note.total, note.currency)} on invoice "
            f"{invoice.number}: {outcome}.")


FORMS: dict[str, type[ff.OperationForm]] = {
    "void": ff.VoidForm, "mark-paid": ff.MarkPaidForm, "retry": ff.RetryForm,
    "pause-dunning": ff.DunningForm, "resume-dunning": ff.DunningForm,
    "write-off": ff.WriteOffForm,
}
OPERATIONS: dict[str, Callable[[ff.OperationForm, Invoice, User], str]] = {
    "void": _do_void, "mark-paid": _do_mark_paid, "retry": _do_retry,
    "pause-dunning": _do_pause, "resume-dunning": _do_resume, "write-off": _do_write_off,
    "credit-note": _do_credit_note,
}


@finance_page(operate=True)
@require_POST
def invoice_operation(request: HttpRequest, public_id: str, operation: str) -> HttpResponse:
    """Run one operation on an invoice (a POST of its form), once per form key."""
    do = OPERATIONS.get(operation)
    if do is None:
        raise Http404("No such operation.")
    found = _invoice(public_id)
    forms = _invoice_forms(found)
    # shown with its message even where the status hides it: the service said why not
    form = forms[operation] = _operation_form(found, operation, request.POST)
    user = cast(User, request.user)  # finance_page: a signed-in finance operator
    if form.is_valid() and run_once(request, form, operation=operation, target=found.public_id,
                                    call=lambda: do(form, found, user)):
        return redirect("finance:invoice", public_id=found.public_id)
    return _invoice_page(request, _invoice(public_id), forms, status=400)


# --- closing periods -------------------------------------------------------------------------

def _organization(public_id: str) -> Organization | None:
    """Return the organization a form names (None: every one); refused when unknown."""
    if not public_id:
        return None
    org = Organization.objects.filter(public_id=public_id).first()
    if org is None:
        raise InvalidRequest(f"No organization {public_id}.", param="organization")
    return org


@finance_page(operate=True)
def close(request: HttpRequest) -> HttpResponse:
    """Preview closing now (nothing written), then close: one organization or all due."""
    preview_form = ff.ClosePreviewForm(request.POST if request.POST.get("step") == "preview"
                                       else None)
    run_form = ff.CloseForm(request.POST if request.POST.get("step") == "run" else None)
    preview = None
    status = 200
    if request.method == "POST" and preview_form.is_bound:
        if preview_form.is_valid():
            try:
                org = _organization(preview_form.cleaned_data["organization"])
                preview = invoicing.period_close_preview(organization=org)
                run_form = ff.CloseForm(initial={
                    "organization": preview_form.cleaned_data["organization"]})
            except DomainError as exc:
                preview_form.add_error("organization", exc.message)
        status = 200 if preview_form.is_valid() else 400
    elif request.method == "POST" and run_form.is_bound:
        user = cast(User, request.user)
        if run_form.is_valid():
            data = run_form.cleaned_data

            def run() -> str:
                org = _organization(data["organization"])
                done = invoicing.period_close_now(organization=org, reason=data["reason"],
                                                  acting_user=user)
                totals = ", ".join(_money(t, c) for c, t in sorted(done.totals.items()))
                failed = (f"; {len(done.failed_orgs)} organization(s) failed and stay open"
                          if done.failed_orgs else "")
                return (f"Closed: {len(done.invoices)} invoice(s) created"
                        f"{' (' + totals + ')' if totals else ''}{failed}.")

            if run_once(request, run_form, operation="close",
                        target=data["organization"] or "all", call=run):
                return redirect("finance:close")
        status = 400
    elif request.method == "POST":
        status = 400
        messages.error(request, "Preview the close first, then run it.")
    return render(request, "finance/close.html", finance_context(
        request, "close", preview_form=preview_form, run_form=run_form, preview=preview),
        status=status)


# --- an organization: credits and one-off items ------------------------------------------------

def _org_or_404(public_id: str) -> Organization:
    org = Organization.objects.filter(public_id=public_id).first()
    if org is None:
        raise Http404("No such organization.")
    return org


def _org_page(request: HttpRequest, org: Organization, forms: dict[str, Any],
              status: int = 200) -> HttpResponse:
    context = finance_context(request, "customers", org=org,
                              grants=credit_grants_of(organization=org)[:50],
                              invoices=finance_reads.invoices_find(
                                  organization_public_id=org.public_id, limit=25))
    context["forms"] = forms if context["can_operate"] else {}
    return render(request, "finance/organization.html", context, status=status)


@finance_page()
def organization(request: HttpRequest, public_id: str) -> HttpResponse:
    org = _org_or_404(public_id)
    return _org_page(request, org, {"grant": ff.GrantForm(), "item": ff.OneOffItemForm()})


@finance_page(operate=True)
@require_POST
def organization_operation(request: HttpRequest, public_id: str, operation: str
                           ) -> HttpResponse:
    """Grant credits, or add a one-off item to the organization's next invoice."""
    if operation not in ("grant", "item"):
        raise Http404("No such operation.")
    org = _org_or_404(public_id)
    forms: dict[str, ff.OperationForm] = {
        "grant": ff.GrantForm(request.POST if operation == "grant" else None),
        "item": ff.OneOffItemForm(request.POST if operation == "item" else None)}
    form = forms[operation]
    user = cast(User, request.user)
    data = form.cleaned_data if form.is_valid() else {}

    def grant() -> str:
        made = plan_services.credit_grant_create(
            organization=org, kind=data["kind"], amount=data["amount"],
            expires_at=data["expires_on"], note=data["reason"], acting_user=user)
        until = f", until {made.expires_at:%Y-%m-%d}" if made.expires_at else ""
        return f"Granted {_money(made.amount, made.currency)} of credit to {org.name}{until}."

    def item() -> str:
        made = invoicing.invoice_item_create(
            organization=org, description=data["description"], amount=data["amount"],
            reason=data["reason"], acting_user=user)
        return (f"{made.description} ({_money(made.amount, made.currency)}) will be on "
                f"{org.name}'s next invoice.")

    if data and run_once(request, form, operation=operation, target=org.public_id,
                         call=grant if operation == "grant" else item):
        return redirect(reverse("finance:organization", args=[org.public_id]))
    return _org_page(request, org, forms, status=400)
