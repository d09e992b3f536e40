"""Admin: invoices read-only (finalized ones never change), payments and webhook events."""

from django.contrib import admin
from django.db.models import Model
from django.http import HttpRequest

from billing_platform.invoicing.models import (
    BillingAccount,
    Invoice,
    InvoiceLine,
    PaymentAttempt,
    StripeEvent,
)


class ReadOnly(admin.ModelAdmin):
    def has_add_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False


class LineInline(admin.TabularInline):
    model = InvoiceLine
    extra = 0
    can_delete = False
    readonly_fields = ("position", "kind", "description", "quantity", "unit_price",
                       "amount_precise", "amount")
    fields = readonly_fields

    def has_add_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False


@admin.register(Invoice)
class InvoiceAdmin(ReadOnly):
    list_display = ("number", "organization", "kind", "status", "period_start", "total",
                    "amount_due", "currency")
    list_filter = ("status", "kind", "currency")
    search_fields = ("number", "public_id", "organization__name")
    inlines = [LineInline]


@admin.register(PaymentAttempt)
class PaymentAttemptAdmin(ReadOnly):
    list_display = ("idempotency_key", "status", "amount", "currency", "failure_code",
                    "created_at")
    list_filter = ("status",)


@admin.register(StripeEvent)
class StripeEventAdmin(ReadOnly):
    list_display = ("stripe_id", "type", "verified", "needs_review", "outcome", "received_at")
    list_filter = ("needs_review", "verified", "type")


@admin.register(BillingAccount)
class BillingAccountAdmin(admin.ModelAdmin):
    list_display = ("organization", "stripe_customer_id", "suspended_for_nonpayment")
    readonly_fields = ("stripe_customer_id",)
