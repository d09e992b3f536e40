"""Invoices API (/api/v1/): list, detail, upcoming, PDF and CSV; the Stripe webhook.

Invoices are read with the ``billing.read`` permission (owner, admin, finance; an API key with
the ``admin`` scope). Another organization's invoice is a 404.
"""

from __future__ import annotations

from typing import Any, ClassVar, cast

from django.http import Http404, HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.utils import extend_schema
from rest_framework import exceptions, serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from billing_platform.accounts.models import User
from billing_platform.accounts.selectors import org_access, organizations_for_user
from billing_platform.api.views import OrgScopedView
from billing_platform.errors import DomainError, InvalidRequest
from billing_platform.invoicing import rendering, selectors, services
from billing_platform.invoicing.builder import DraftInvoice
from billing_platform.invoicing.metrics import stripe_webhook_counted
from billing_platform.invoicing.models import Invoice


class LineSerializer(serializers.Serializer[Any]):
    kind = serializers.CharField()
    description = serializers.CharField()
    model = serializers.CharField()
    region = serializers.CharField()
    service_tier = serializers.CharField()
    capacity_source = serializers.CharField()
    token_class = serializers.CharField()
    source_period_start = serializers.DateTimeField(allow_null=True)
    source_period_end = serializers.DateTimeField(allow_null=True)
    quantity = serializers.DecimalField(max_digits=30, decimal_places=6)
    unit = serializers.CharField()
    unit_price = serializers.DecimalField(max_digits=30, decimal_places=10, allow_null=True)
    amount_precise = serializers.DecimalField(max_digits=30, decimal_places=10)
    amount = serializers.DecimalField(max_digits=24, decimal_places=4)
    details = serializers.JSONField()


class InvoiceSerializer(serializers.Serializer[Any]):
    id = serializers.CharField(source="public_id")
    object = serializers.SerializerMethodField()
    number = serializers.CharField(allow_null=True)
    kind = serializers.CharField()
    status = serializers.CharField()
    currency = serializers.CharField()
    period_start = serializers.DateTimeField()
    period_end = serializers.DateTimeField()
    subtotal = serializers.DecimalField(max_digits=24, decimal_places=4)
    tax = serializers.DecimalField(max_digits=24, decimal_places=4)
    credits_applied = serializers.DecimalField(max_digits=24, decimal_places=4)
    total = serializers.DecimalField(max_digits=24, decimal_places=4)
    amount_due = serializers.DecimalField(max_digits=24, decimal_places=4)
    amount_paid = serializers.DecimalField(max_digits=24, decimal_places=4)
    finalized_at = serializers.DateTimeField(allow_null=True)
    due_at = serializers.DateTimeField(allow_null=True)
    paid_at = serializers.DateTimeField(allow_null=True)

    def get_object(self, obj: Invoice) -> str:
        return "invoice"


class InvoiceDetailSerializer(InvoiceSerializer):
    lines = LineSerializer(many=True, source="lines.all")


def upcoming_data(draft: DraftInvoice) -> dict[str, Any]:
    """Serialize the upcoming (not stored) invoice like a stored one."""
    return {
        "object": "upcoming_invoice", "status": "draft", "currency": draft.currency,
        "period_start": draft.target.period_start, "period_end": draft.target.period_end,
        # money as decimal strings, like the stored invoice's serializer (never floats)
        "subtotal": str(draft.subtotal), "tax": str(draft.tax),
        "credits_applied": str(draft.credits_applied), "total": str(draft.total),
        "amount_due": str(draft.total),
        "lines": LineSerializer(draft.lines, many=True).data,
    }


class BillingView(OrgScopedView):
    permission_for: ClassVar[dict[str, str]] = {"GET": "billing.read"}

    def invoice(self, invoice_id: str) -> Invoice:
        invoice = selectors.invoice_get(organization=self.org, public_id=invoice_id)
        if invoice is None:
            raise Http404("No such invoice.")
        return invoice


class InvoiceListApi(BillingView):
    @extend_schema(responses=InvoiceSerializer(many=True))
    def get(self, request: Request, org_id: str) -> Response:
        rows = selectors.invoices_of(organization=self.org)[:100]
        return Response({"object": "list", "data": InvoiceSerializer(rows, many=True).data})


class InvoiceDetailApi(BillingView):
    @extend_schema(responses=InvoiceDetailSerializer)
    def get(self, request: Request, org_id: str, invoice_id: str) -> Response:
        return Response(InvoiceDetailSerializer(self.invoice(invoice_id)).data)


class InvoicePdfApi(BillingView):
    @extend_schema(responses={(200, "application/pdf"): bytes})
    def get(self, request: Request, org_id: str, invoice_id: str) -> HttpResponse:
        invoice = self.invoice(invoice_id)
        response = HttpResponse(rendering.invoice_pdf(invoice, self.org),
                                content_type="application/pdf")
        response["Content-Disposition"] = f'inline; filename="{invoice.number}.pdf"'
        return response


class InvoiceCsvApi(BillingView):
    @extend_schema(responses={(200, "text/csv"): str})
    def get(self, request: Request, org_id: str, invoice_id: str) -> HttpResponse:
        invoice = self.invoice(invoice_id)
        response = HttpResponse(rendering.invoice_csv(invoice), content_type="text/csv")
        response["Content-Disposition"] = f'attachment; filename="{invoice.number}.csv"'
        return response


class UpcomingInvoiceApi(APIView):
    """GET /api/v1/invoices/upcoming (an API key's org, or ?organization= for a user)."""

    @extend_schema(responses={200: dict})
    def get(self, request: Request, org_id: str | None = None) -> Response:
        org_param = org_id or request.query_params.get("organization")
        principal = getattr(request.user, "principal", None)
        if principal is not None:
            access = org_access(user=None, principal=principal,
                                org_public_id=org_param or principal.org_public_id)
        else:
            if not org_param:
                # IsAuthenticated (the default permission) let only a signed-in user here
                orgs = list(organizations_for_user(user=cast(User, request.user))[:2])
                if len(orgs) != 1:
                    raise InvalidRequest("organization is required.", param="organization")
                org_param = orgs[0].public_id
            access = org_access(user=request.user, principal=None, org_public_id=org_param)
        if not access.can("billing.read"):
            raise exceptions.PermissionDenied(
                f"Your role ({access.role}) does not allow this (billing.read).")
        draft = selectors.upcoming_invoice(organization=access.organization)
        return Response(upcoming_data(draft))


@csrf_exempt
def stripe_webhook(request: HttpRequest) -> HttpResponse:
    """Receive a Stripe webhook: signature verified, then stored and applied once."""
    if request.method != "POST":
        return HttpResponse(status=405)
    # Read at most one byte past the limit, so an oversized body is refused without being
    # held whole (the service says how large a body may be).
    payload = request.read(services.STRIPE_WEBHOOK_MAX_BYTES + 1)
    try:
        event = services.stripe_webhook_receive(
            payload=payload, signature=request.headers.get("Stripe-Signature", ""))
    except DomainError as exc:
        stripe_webhook_counted(error=exc)
        return HttpResponse(exc.message, status=exc.status, content_type="text/plain")
    except Exception as exc:
        stripe_webhook_counted(error=exc)
        raise
    stripe_webhook_counted(outcome=event.outcome)
    return HttpResponse(event.outcome or "ok", content_type="text/plain")
