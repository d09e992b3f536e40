"""``/api/v1/finance/`` operations: what a finance controller does to invoices and accounts.

Close periods now (with ``dry_run``, a preview that creates nothing), void, credit notes,
payments recorded by hand, a charge retried now, dunning held and resumed, write-offs, credit
grants and one-off items for an organization's next invoice. Each POST needs
``finance.operate`` (``FinanceOperator``: anyone else, an analyst included, gets 404), takes a
required ``reason``, honours ``Idempotency-Key`` (``@idempotent``: a retry returns the first
answer and does nothing again), and calls one invoicing or plans service that writes its audit
row, with the caller and the reason, in its transaction. Refusals are domain errors that the
API's handler answers (a paid invoice cannot be voided: 409; a credit beyond what remains:
400), and nothing of a refused operation is written.

Invoices and organizations are addressed by public id, across organizations (finance's are
platform-wide); an id that is not a finalized invoice (a draft, a credit note, a forged id) is
a 404, as is an unknown organization.
"""

from __future__ import annotations

from typing import Any, ClassVar, cast

from django.http import Http404
from django.utils import timezone
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from billing_platform.accounts.models import Organization, User
from billing_platform.finance.permissions import FinanceOperator
from billing_platform.idempotency.services import idempotent
from billing_platform.invoicing import services
from billing_platform.invoicing.apis import InvoiceSerializer, LineSerializer
from billing_platform.invoicing.choices import CreditOutcome, InvoiceKind, InvoiceStatus
from billing_platform.invoicing.finance_reads import invoice_find
from billing_platform.invoicing.models import Invoice, PendingInvoiceItem, Refund
from plans import services as plan_services
from plans.choices import CreditGrantKind
from plans.models import CreditGrant

MAX_CREDIT_LINES = 500


def _money(**kwargs: Any) -> serializers.DecimalField:
    """An invoice amount: 4 places hold every minor unit; the service checks the currency's."""
    return serializers.DecimalField(max_digits=20, decimal_places=4, **kwargs)


class ReasonSerializer(serializers.Serializer[Any]):
    reason = serializers.CharField(max_length=500, help_text="Why: kept in the audit row.")


class CloseSerializer(serializers.Serializer[Any]):
    organization = serializers.CharField(max_length=40, required=False,
                                         help_text="One organization; all that are due if absent.")
    dry_run = serializers.BooleanField(default=False,
                                       help_text="Preview the invoices; create nothing.")
    reason = serializers.CharField(max_length=500, required=False, default="")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if not attrs["dry_run"] and not attrs["reason"].strip():
            raise serializers.ValidationError({"reason": ["A close needs a reason."]})
        return attrs


class LineCreditSerializer(serializers.Serializer[Any]):
    line = serializers.IntegerField(min_value=1, help_text="The invoice line's position.")
    amount = _money(required=False, allow_null=True, default=None,
                    help_text="Absent: all that is left of the line.")


class CreditNoteSerializer(ReasonSerializer):
    amount = _money(required=False)
    lines = LineCreditSerializer(many=True, required=False, allow_empty=False)
    outcome = serializers.ChoiceField(choices=CreditOutcome.choices, required=False,
                                      help_text="A paid invoice: refund or credit_balance.")

    def validate_lines(self, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if len(value) > MAX_CREDIT_LINES:
            raise serializers.ValidationError(f"At most {MAX_CREDIT_LINES} lines.")
        return value

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if ("amount" in attrs) == ("lines" in attrs):
            raise serializers.ValidationError("Give either amount or lines.")
        return attrs


class MarkPaidSerializer(ReasonSerializer):
    reference = serializers.CharField(max_length=200,
                                      help_text="The bank transfer's reference.")


class CreditGrantSerializer(ReasonSerializer):
    kind = serializers.ChoiceField(choices=[CreditGrantKind.PROMOTIONAL,
                                            CreditGrantKind.GOODWILL])
    amount = serializers.DecimalField(max_digits=24, decimal_places=10)
    currency = serializers.RegexField(r"^[A-Za-z]{3}$", required=False,
                                      help_text="ISO code; the organization's if absent.")
    expires_at = serializers.DateTimeField(required=False, allow_null=True, default=None)

    def validate_expires_at(self, value: Any) -> Any:
        if value is not None and value <= timezone.now():
            raise serializers.ValidationError("expires_at must be in the future.")
        return value


class InvoiceItemSerializer(ReasonSerializer):
    description = serializers.CharField(max_length=300)
    amount = _money()


class FinanceInvoiceSerializer(InvoiceSerializer):
    organization = serializers.CharField(source="organization.public_id")
    voided_at = serializers.DateTimeField(allow_null=True)
    marked_uncollectible_at = serializers.DateTimeField(allow_null=True)
    written_off_at = serializers.DateTimeField(allow_null=True)
    dunning_paused_at = serializers.DateTimeField(allow_null=True)
    next_payment_attempt_at = serializers.DateTimeField(allow_null=True)
    payment_reference = serializers.CharField()


class CreditNoteOutSerializer(FinanceInvoiceSerializer):
    corrects = serializers.CharField(source="corrects.public_id")
    credit_outcome = serializers.CharField()
    lines = LineSerializer(many=True, source="lines.all")

    def get_object(self, obj: Invoice) -> str:
        return "credit_note"


class RefundOutSerializer(serializers.ModelSerializer[Refund]):
    class Meta:
        model = Refund
        fields = ["status", "amount", "currency", "idempotency_key", "stripe_refund_id"]


class CreditNoteResultSerializer(serializers.Serializer[Any]):
    credit_note = CreditNoteOutSerializer()
    invoice = FinanceInvoiceSerializer(source="credit_note.corrects")
    refund = RefundOutSerializer(source="credit_note.refund", allow_null=True, default=None)


class GrantOutSerializer(serializers.ModelSerializer[CreditGrant]):
    id = serializers.CharField(source="public_id")
    organization = serializers.CharField(source="organization.public_id")

    class Meta:
        model = CreditGrant
        fields = ["id", "organization", "kind", "currency", "amount", "remaining",
                  "granted_at", "expires_at", "note"]


class ItemOutSerializer(serializers.ModelSerializer[PendingInvoiceItem]):
    id = serializers.CharField(source="public_id")
    organization = serializers.CharField(source="organization.public_id")
    invoice = serializers.CharField(source="invoice.public_id", allow_null=True, default=None)

    class Meta:
        model = PendingInvoiceItem
        fields = ["id", "organization", "description", "amount", "currency", "created_at",
                  "invoice"]


def _close_data(result: services.CloseResult) -> dict[str, Any]:
    def money(value: Any) -> str | None:
        return None if value is None else str(value)

    return {
        "object": "period_close", "dry_run": result.dry_run,
        "invoices": [{
            "organization": i.organization, "organization_name": i.organization_name,
            "id": i.invoice or None, "number": i.number or None, "status": i.status,
            "currency": i.currency, "period_start": i.period_start.isoformat(),
            "period_end": i.period_end.isoformat(), "subtotal": str(i.subtotal),
            "tax": str(i.tax), "credits_applied": str(i.credits_applied),
            "total": str(i.total), "amount_due": str(i.amount_due),
            "lines": [{"kind": ln.kind, "description": ln.description,
                       "quantity": str(ln.quantity), "unit": ln.unit,
                       "unit_price": money(ln.unit_price), "amount": str(ln.amount)}
                      for ln in i.lines]} for i in result.invoices],
        "totals": {currency: str(total) for currency, total in result.totals.items()},
        "failed_organizations": result.failed_orgs, "skipped_locked": result.skipped_locked,
    }


class OperationView(APIView):
    """A finance operation: ``finance.operate`` or 404; the body validated by ``body_class``."""

    permission_classes = [FinanceOperator]
    body_class: ClassVar[type[serializers.Serializer[Any]]] = ReasonSerializer

    def body(self, request: Request) -> dict[str, Any]:
        body = self.body_class(data=request.data)
        body.is_valid(raise_exception=True)
        return dict(body.validated_data)

    def invoice(self, public_id: str) -> Invoice:
        invoice = invoice_find(public_id=public_id)
        if invoice is None or invoice.kind != InvoiceKind.INVOICE:
            raise Http404("No such invoice.")
        return invoice

    def organization(self, public_id: str) -> Organization:
        org = Organization.objects.filter(public_id=public_id).first()
        if org is None:
            raise Http404("No such organization.")
        return org


class PeriodCloseApi(OperationView):
    """``POST finance/periods/close/``: close ended periods now, or preview (``dry_run``)."""

    body_class = CloseSerializer

    @extend_schema(request=CloseSerializer, responses={200: dict})
    @idempotent
    def post(self, request: Request) -> Response:
        data = self.body(request)
        org = self.organization(data["organization"]) if data.get("organization") else None
        if data["dry_run"]:
            result = services.period_close_preview(organization=org)
        else:
            result = services.period_close_now(organization=org, reason=data["reason"],
                                               acting_user=request.user)
        return Response(_close_data(result))


class InvoiceOperationApi(OperationView):
    """``POST finance/invoices/<id>/<operation>/``: one service (``act``) on one invoice."""

    answer_status: ClassVar[int] = status.HTTP_200_OK

    def act(self, invoice: Invoice, data: dict[str, Any], user: Any) -> Invoice:
        raise NotImplementedError

    @idempotent
    def post(self, request: Request, invoice_id: str) -> Response:
        invoice = self.invoice(invoice_id)
        data = self.body(request)
        invoice = self.act(invoice, data, request.user)
        invoice.refresh_from_db()
        return Response(FinanceInvoiceSerializer(invoice).data, status=self.answer_status)


_invoice_answer = extend_schema(request=ReasonSerializer,
                                responses={200: FinanceInvoiceSerializer})


@extend_schema_view(post=_invoice_answer)
class InvoiceVoidApi(InvoiceOperationApi):
    def act(self, invoice: Invoice, data: dict[str, Any], user: Any) -> Invoice:
        return services.invoice_void(invoice=invoice, reason=data["reason"], acting_user=user)


@extend_schema_view(post=extend_schema(request=MarkPaidSerializer,
                                       responses={200: FinanceInvoiceSerializer}))
class InvoiceMarkPaidApi(InvoiceOperationApi):
    body_class = MarkPaidSerializer

    def act(self, invoice: Invoice, data: dict[str, Any], user: Any) -> Invoice:
        return services.invoice_mark_paid(invoice=invoice, reference=data["reference"],
                                          reason=data["reason"], acting_user=user)


@extend_schema_view(post=extend_schema(request=ReasonSerializer,
                                       responses={202: FinanceInvoiceSerializer}))
class InvoiceRetryChargeApi(InvoiceOperationApi):
    answer_status = status.HTTP_202_ACCEPTED  # the charge goes out after commit (a task)

    def act(self, invoice: Invoice, data: dict[str, Any], user: Any) -> Invoice:
        return services.invoice_charge_retry(invoice=invoice, reason=data["reason"],
                                             acting_user=user)


@extend_schema_view(post=_invoice_answer)
class InvoiceDunningPauseApi(InvoiceOperationApi):
    def act(self, invoice: Invoice, data: dict[str, Any], user: Any) -> Invoice:
        return services.invoice_dunning_pause(invoice=invoice, reason=data["reason"],
                                              acting_user=user)


@extend_schema_view(post=_invoice_answer)
class InvoiceDunningResumeApi(InvoiceOperationApi):
    def act(self, invoice: Invoice, data: dict[str, Any], user: Any) -> Invoice:
        return services.invoice_dunning_resume(invoice=invoice, reason=data["reason"],
                                               acting_user=user)


@extend_schema_view(post=_invoice_answer)
class InvoiceWriteOffApi(InvoiceOperationApi):
    def act(self, invoice: Invoice, data: dict[str, Any], user: Any) -> Invoice:
        return services.invoice_write_off(invoice=invoice, reason=data["reason"],
                                          acting_user=user)


class CreditNoteCreateApi(OperationView):
    """``POST finance/invoices/<id>/credit-notes/``: by ``amount`` or ``lines``; on a paid
    invoice ``outcome`` says refund (through Stripe) or credit_balance."""

    body_class = CreditNoteSerializer

    @extend_schema(request=CreditNoteSerializer, responses={201: CreditNoteResultSerializer})
    @idempotent
    def post(self, request: Request, invoice_id: str) -> Response:
        invoice = self.invoice(invoice_id)
        data = self.body(request)
        if invoice.status == InvoiceStatus.PAID and "outcome" not in data:
            raise serializers.ValidationError(
                {"outcome": ["A paid invoice's credit is a refund or a credit_balance."]})
        lines = None if "lines" not in data else [
            services.LineCredit(position=ln["line"], amount=ln["amount"]) for ln in data["lines"]]
        note = services.credit_note_create(
            invoice=invoice, amount=data.get("amount"), lines=lines,
            outcome=data.get("outcome"), reason=data["reason"], acting_user=request.user)
        note = Invoice.objects.select_related("corrects__organization", "organization").get(
            pk=note.pk)  # the corrected invoice as the note left it
        return Response(CreditNoteResultSerializer({"credit_note": note}).data,
                        status=status.HTTP_201_CREATED)


class CreditGrantCreateApi(OperationView):
    """``POST finance/organizations/<id>/credit-grants/``: promotional or goodwill credit."""

    body_class = CreditGrantSerializer

    @extend_schema(request=CreditGrantSerializer, responses={201: GrantOutSerializer})
    @idempotent
    def post(self, request: Request, org_id: str) -> Response:
        org = self.organization(org_id)
        data = self.body(request)
        grant = plan_services.credit_grant_create(
            organization=org, kind=data["kind"], amount=data["amount"],
            currency=data.get("currency"), expires_at=data["expires_at"],
            note=data["reason"], created_by=cast(User, request.user),  # FinanceOperator: a user
            acting_user=request.user)
        return Response(GrantOutSerializer(grant).data, status=status.HTTP_201_CREATED)


class InvoiceItemCreateApi(OperationView):
    """``POST finance/organizations/<id>/invoice-items/``: a one-off item on the next invoice."""

    body_class = InvoiceItemSerializer

    @extend_schema(request=InvoiceItemSerializer, responses={201: ItemOutSerializer})
    @idempotent
    def post(self, request: Request, org_id: str) -> Response:
        org = self.organization(org_id)
        data = self.body(request)
        item = services.invoice_item_create(
            organization=org, description=data["description"], amount=data["amount"],
            reason=data["reason"], acting_user=request.user)
        return Response(ItemOutSerializer(item).data, status=status.HTTP_201_CREATED)
