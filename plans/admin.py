"""Django admin for staff: the catalog, what customers hold, and (read-only) token-plan state.
Every change made here writes an audit row (``AuditedModelAdmin``).

A price version that has taken effect is read-only here: events were rated with it, so a
change goes into a new version (API ``POST /api/v1/price_books/<code>/versions/``, which copies
the previous version forward).
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest
from django.utils import timezone

from billing_platform.audit.admin import AuditedModelAdmin
from plans.choices import ReservationTerm
from plans.models import (
    Budget,
    BudgetAlert,
    ContextBand,
    CreditCoefficient,
    CreditGrant,
    CreditGrantApplication,
    CreditPack,
    CreditPackPurchase,
    ModelPrice,
    Plan,
    PriceBook,
    PriceMultiplier,
    PriceVersion,
    ProvisionedOffering,
    QuotaLimit,
    Reservation,
    Subscription,
    TokenPlanPeriod,
    TokenPlanUsage,
)


def _in_force(version: PriceVersion | None) -> bool:
    return version is not None and version.effective_from <= timezone.now()


class _FrozenWhenInForce:
    """Inline mixin: rows of a version in force cannot be added, changed or deleted."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return not _in_force(obj) and super().has_add_permission(request, obj)  # type: ignore[misc]

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return not _in_force(obj) and super().has_change_permission(request, obj)  # type: ignore[misc]

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return not _in_force(obj) and super().has_delete_permission(request, obj)  # type: ignore[misc]


class PriceVersionInline(admin.TabularInline):
    model = PriceVersion
    extra = 0
    fields = ["effective_from", "note"]
    readonly_fields = ["effective_from", "note"]
    show_change_link = True
    can_delete = False


@admin.register(PriceBook)
class PriceBookAdmin(AuditedModelAdmin):
    list_display = ["code", "name", "currency", "is_default"]
    list_filter = ["currency", "is_default"]
    inlines = [PriceVersionInline]


class ModelPriceInline(_FrozenWhenInForce, admin.TabularInline):
    model = ModelPrice
    extra = 0
    show_change_link = True


class PriceMultiplierInline(_FrozenWhenInForce, admin.TabularInline):
    model = PriceMultiplier
    extra = 0


@admin.register(PriceVersion)
class PriceVersionAdmin(AuditedModelAdmin):
    list_display = ["price_book", "effective_from", "note", "created_at"]
    list_filter = ["price_book"]
    inlines = [ModelPriceInline, PriceMultiplierInline]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return ["price_book", "effective_from"] if _in_force(obj) else []


class ContextBandInline(admin.TabularInline):
    model = ContextBand
    extra = 0

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return not (obj and _in_force(obj.version)) and super().has_change_permission(request, obj)

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return not (obj and _in_force(obj.version)) and super().has_add_permission(request, obj)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return not (obj and _in_force(obj.version)) and super().has_delete_permission(request, obj)


@admin.register(ModelPrice)
class ModelPriceAdmin(AuditedModelAdmin):
    list_display = ["model", "version", "input", "cached_input", "output", "cache_write"]
    list_filter = ["version__price_book"]
    search_fields = ["model"]
    inlines = [ContextBandInline]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        if obj is not None and _in_force(obj.version):
            return ["version", "model", "input", "cached_input", "output", "cache_write"]
        return []


class CreditCoefficientInline(admin.TabularInline):
    model = CreditCoefficient
    extra = 0


class CreditPackInline(admin.TabularInline):
    model = CreditPack
    extra = 0


@admin.register(Plan)
class PlanAdmin(AuditedModelAdmin):
    list_display = ["code", "name", "kind", "currency", "monthly_fee", "credits_per_period",
                    "window_credits", "cap_policy", "is_public", "is_active"]
    list_filter = ["kind", "is_active"]
    inlines = [CreditCoefficientInline, CreditPackInline]


class PackPurchaseInline(admin.TabularInline):
    model = CreditPackPurchase
    extra = 0
    readonly_fields = ["credits_used"]


@admin.register(Subscription)
class SubscriptionAdmin(AuditedModelAdmin):
    list_display = ["public_id", "organization", "plan", "starts_at", "ends_at", "data_zone"]
    list_filter = ["plan"]
    search_fields = ["public_id", "organization__name", "organization__public_id"]
    raw_id_fields = ["organization"]
    inlines = [PackPurchaseInline]


class _ReadOnly(admin.ModelAdmin):
    """State written only by rating: visible to staff, never edited by hand."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(TokenPlanPeriod)
class TokenPlanPeriodAdmin(_ReadOnly):
    list_display = ["subscription", "period_start", "period_end", "plan_credits",
                    "pack_credits", "overage_credits", "updated_at"]


@admin.register(TokenPlanUsage)
class TokenPlanUsageAdmin(_ReadOnly):
    list_display = ["request_id", "subscription", "event_time", "plan_credits", "pack_credits",
                    "overage_credits"]
    search_fields = ["request_id"]


@admin.register(ProvisionedOffering)
class ProvisionedOfferingAdmin(AuditedModelAdmin):
    list_display = ["code", "model", "region", "tokens_per_minute_per_unit", "output_burndown",
                    "hourly_unit_price", "monthly_unit_price", "currency", "is_active"]


@admin.register(Reservation)
class ReservationAdmin(AuditedModelAdmin):
    list_display = ["public_id", "organization", "model", "region", "units", "term",
                    "term_count", "overflow_policy", "starts_at", "ends_at"]
    list_filter = ["model", "region", "term"]
    search_fields = ["public_id", "organization__name"]
    raw_id_fields = ["organization"]
    readonly_fields = ["model", "region", "unit_price", "currency", "tokens_per_minute_per_unit",
                       "cache_burndown", "output_burndown"]

    def get_exclude(self, request: HttpRequest, obj: Any = None) -> list[str]:
        # On add the terms are copied from the offering (save_model), not typed by hand.
        return list(self.readonly_fields) if obj is None else []

    def save_model(self, request: HttpRequest, obj: Reservation, form: Any, change: bool) -> None:
        if not change:
            offering = obj.offering
            obj.model, obj.region, obj.currency = offering.model, offering.region, offering.currency
            obj.unit_price = (offering.hourly_unit_price if obj.term == ReservationTerm.HOURLY
                              else offering.monthly_unit_price)
            obj.tokens_per_minute_per_unit = offering.tokens_per_minute_per_unit
            obj.cache_burndown = offering.cache_burndown
            obj.output_burndown = offering.output_burndown
        super().save_model(request, obj, form, change)


class GrantApplicationInline(admin.TabularInline):
    model = CreditGrantApplication
    extra = 0
    can_delete = False
    readonly_fields = ["reference", "amount", "applied_at"]

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(CreditGrant)
class CreditGrantAdmin(AuditedModelAdmin):
    list_display = ["public_id", "organization", "kind", "amount", "remaining", "currency",
                    "expires_at"]
    list_filter = ["kind", "currency"]
    search_fields = ["public_id", "organization__name"]
    raw_id_fields = ["organization", "created_by"]
    readonly_fields = ["remaining"]
    inlines = [GrantApplicationInline]

    def save_model(self, request: HttpRequest, obj: CreditGrant, form: Any, change: bool) -> None:
        if not change:
            obj.remaining = obj.amount
            obj.created_by = request.user  # type: ignore[assignment]
        super().save_model(request, obj, form, change)


# --- quotas -------------------------------------------------------------------------------------


@admin.register(QuotaLimit)
class QuotaLimitAdmin(AuditedModelAdmin):
    list_display = ("organization", "project", "api_key", "usage_tier", "rpm", "tpm",
                    "allowed_regions")
    raw_id_fields = ("organization", "project", "api_key")


@admin.register(Budget)
class BudgetAdmin(AuditedModelAdmin):
    list_display = ("public_id", "organization", "project", "amount", "currency", "hard",
                    "suspended_at")
    raw_id_fields = ("organization", "project")
    readonly_fields = ("public_id", "webhook_secret", "suspended_at")


@admin.register(BudgetAlert)
class BudgetAlertAdmin(admin.ModelAdmin):
    list_display = ("budget", "period_start", "threshold", "spend", "email_sent_at",
                    "webhook_status")

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
