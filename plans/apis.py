"""Plans management API (/api/v1/): catalog (staff write), what a customer holds, quotes.

Catalog endpoints (price books, plans, provisioned offerings) are readable by any signed-in
caller (customers see the public part) and writable by staff. Organization endpoints resolve the
organization first, so a non-member gets 404 whatever the method; members read, staff write
(a member's write is 403). Views stay thin: validate, call one service or selector, serialize.

Length: one short view class per endpoint of the catalog and of an organization's holdings,
each a few lines over a serializer; split by resource when the next surface lands here.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any, cast

from django.db.models import QuerySet
from django.shortcuts import get_object_or_404
from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import exceptions, status
from rest_framework import serializers as drf_serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from billing_platform.accounts.choices import Role
from billing_platform.accounts.models import ApiKey, Organization, User
from billing_platform.accounts.selectors import OrgAccess, org_access
from billing_platform.api.views import OrgScopedView
from billing_platform.audit.selectors import quota_audit_events
from billing_platform.errors import InvalidRequest, NotFound
from billing_platform.idempotency.services import idempotent
from plans import limits, quotas, selectors, services
from plans import serializers as s
from plans.models import (
    Budget,
    CreditPack,
    EndUserBudget,
    Plan,
    PriceBook,
    PriceVersion,
    Reservation,
    Subscription,
)
from plans.periods import month_bounds
from plans.rating import quote

STAFF = "staff"


def is_staff(user: Any) -> bool:
    """Return True for a signed-in staff person (an API key is never staff)."""
    return bool(getattr(user, "is_staff", False)) and not hasattr(user, "principal")


class StaffWriteView(APIView):
    """Catalog endpoints: anyone signed in reads, only staff write."""

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)
        if request.method not in ("GET", "HEAD", "OPTIONS") and not is_staff(request.user):
            raise exceptions.PermissionDenied("Only Tollgate staff can change the catalog.")

    @property
    def staff(self) -> bool:
        return is_staff(self.request.user)


class PlansOrgView(OrgScopedView):
    """Organization endpoints: staff act on every organization; ``"staff"`` marks staff-only."""

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        needed = self.permission_for.get(request.method or "GET", "read")
        if is_staff(request.user):
            APIView.initial(self, request, *args, **kwargs)
            org = Organization.objects.filter(public_id=kwargs["org_id"]).first()
            if org is None:
                raise NotFound("No such organization.")
            self.access = OrgAccess(org, Role.OWNER)
            return
        if needed == STAFF:
            # Resolve membership first (non-members get 404), then refuse the write.
            # on this view instance only (one per request): the class map stays as it is
            self.permission_for = {  # type: ignore[misc]
                **self.permission_for, request.method or "GET": "read"}
            super().initial(request, *args, **kwargs)
            raise exceptions.PermissionDenied("Only Tollgate staff can change this.")
        super().initial(request, *args, **kwargs)


# --- price books -------------------------------------------------------------------------------

class PriceBookListApi(StaffWriteView):
    @extend_schema(responses=s.PriceBookSerializer(many=True))
    def get(self, request: Request) -> Response:
        books = selectors.price_books_visible(staff=self.staff)
        return Response({"object": "list",
                         "data": s.PriceBookSerializer(books, many=True).data})

    @extend_schema(request=s.PriceBookSerializer, responses={201: s.PriceBookSerializer})
    def post(self, request: Request) -> Response:
        body = s.PriceBookSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        book = services.price_book_create(acting_user=request.user, **body.validated_data)
        return Response(s.PriceBookSerializer(book).data, status=status.HTTP_201_CREATED)


def _versions(book: PriceBook) -> QuerySet[PriceVersion]:
    return (PriceVersion.objects.filter(price_book=book)
            .prefetch_related("prices__bands", "multipliers").order_by("-effective_from"))


class PriceBookDetailApi(StaffWriteView):
    def book(self, code: str) -> PriceBook:
        return get_object_or_404(selectors.price_books_visible(staff=self.staff), code=code)

    @extend_schema(responses=s.PriceBookSerializer)
    def get(self, request: Request, code: str) -> Response:
        book = self.book(code)
        data = s.PriceBookSerializer(book).data
        current = selectors.price_version_at(price_book=book)
        data["current_version"] = (
            s.PriceVersionSerializer(_versions(book).get(pk=current.pk)).data
            if current else None)
        return Response(data)


class PriceVersionListApi(PriceBookDetailApi):
    @extend_schema(responses=s.PriceVersionSerializer(many=True))
    def get(self, request: Request, code: str) -> Response:
        versions = _versions(self.book(code))
        return Response({"object": "list",
                         "data": s.PriceVersionSerializer(versions, many=True).data})

    @extend_schema(request=s.PriceVersionCreateSerializer,
                   responses={201: s.PriceVersionSerializer})
    def post(self, request: Request, code: str) -> Response:
        body = s.PriceVersionCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        book = self.book(code)
        version = services.price_version_create(
            acting_user=request.user, price_book=book, **body.validated_data)
        return Response(s.PriceVersionSerializer(_versions(book).get(pk=version.pk)).data,
                        status=status.HTTP_201_CREATED)


class PriceVersionDetailApi(PriceBookDetailApi):
    @extend_schema(responses=s.PriceVersionSerializer)
    # its URL has one more parameter than the book's (DRF passes URL kwargs by name): it
    # inherits book() and the permissions, not a get() callable in the book's place
    def get(  # type: ignore[override]
            self, request: Request, code: str, version_id: int) -> Response:
        version = get_object_or_404(_versions(self.book(code)), pk=version_id)
        return Response(s.PriceVersionSerializer(version).data)


# --- plans and offerings -----------------------------------------------------------------------

class PlanListApi(StaffWriteView):
    @extend_schema(responses=s.PlanSerializer(many=True))
    def get(self, request: Request) -> Response:
        plans = selectors.plans_visible(staff=self.staff)
        return Response({"object": "list", "data": s.PlanSerializer(plans, many=True).data})

    @extend_schema(request=s.PlanSerializer, responses={201: s.PlanSerializer})
    def post(self, request: Request) -> Response:
        body = s.PlanSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        plan = services.plan_create(acting_user=request.user, **body.validated_data)
        return Response(s.PlanSerializer(plan).data, status=status.HTTP_201_CREATED)


class PlanDetailApi(StaffWriteView):
    def plan(self, code: str) -> Plan:
        return get_object_or_404(selectors.plans_visible(staff=self.staff), code=code)

    @extend_schema(responses=s.PlanSerializer)
    def get(self, request: Request, code: str) -> Response:
        return Response(s.PlanSerializer(self.plan(code)).data)

    @extend_schema(request=s.PlanUpdateSerializer, responses=s.PlanSerializer)
    def patch(self, request: Request, code: str) -> Response:
        body = s.PlanUpdateSerializer(data=request.data, partial=True)
        body.is_valid(raise_exception=True)
        plan = services.plan_update(
            acting_user=request.user, plan=self.plan(code), **body.validated_data)
        return Response(s.PlanSerializer(Plan.objects.get(pk=plan.pk)).data)


class CreditPackListApi(PlanDetailApi):
    @extend_schema(request=s.CreditPackCreateSerializer, responses={201: s.CreditPackSerializer})
    def post(self, request: Request, code: str) -> Response:
        body = s.CreditPackCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        pack = services.credit_pack_create(
            acting_user=request.user, plan=self.plan(code), **body.validated_data)
        return Response(s.CreditPackSerializer(pack).data, status=status.HTTP_201_CREATED)


class OfferingListApi(StaffWriteView):
    @extend_schema(responses=s.ProvisionedOfferingSerializer(many=True))
    def get(self, request: Request) -> Response:
        offerings = selectors.offerings_visible(staff=self.staff)
        return Response({"object": "list",
                         "data": s.ProvisionedOfferingSerializer(offerings, many=True).data})

    @extend_schema(request=s.ProvisionedOfferingSerializer,
                   responses={201: s.ProvisionedOfferingSerializer})
    def post(self, request: Request) -> Response:
        body = s.ProvisionedOfferingSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        offering = services.provisioned_offering_create(
            acting_user=request.user, **body.validated_data)
        return Response(s.ProvisionedOfferingSerializer(offering).data,
                        status=status.HTTP_201_CREATED)


# --- an organization's subscription, packs, reservations, credit -------------------------------

def _subscription_body(subscription: Subscription | None) -> dict[str, Any]:
    if subscription is None:
        return {"object": "subscription", "plan": None, "plan_kind": "on_demand",
                "token_plan": None}
    data = dict(s.SubscriptionSerializer(subscription).data)
    data["object"] = "subscription"
    status_ = selectors.token_plan_status(subscription=subscription)
    data["token_plan"] = s.TokenPlanStatusSerializer(status_).data if status_ else None
    return data


class CurrentSubscriptionApi(PlansOrgView):
    permission_for = {"GET": "read"}

    @extend_schema(responses=s.SubscriptionSerializer,
                   description="The plan in force now and, for a token plan, the credits left.")
    def get(self, request: Request, org_id: str) -> Response:
        return Response(_subscription_body(selectors.subscription_at(organization=self.org)))


class SubscriptionListApi(PlansOrgView):
    permission_for = {"GET": "read", "POST": STAFF}

    @extend_schema(responses=s.SubscriptionSerializer(many=True))
    def get(self, request: Request, org_id: str) -> Response:
        subs = self.org.subscriptions.select_related("plan").order_by("-starts_at")
        return Response({"object": "list",
                         "data": s.SubscriptionSerializer(subs, many=True).data})

    @extend_schema(request=s.SubscriptionCreateSerializer,
                   responses={201: s.SubscriptionSerializer})
    @idempotent
    def post(self, request: Request, org_id: str) -> Response:
        body = s.SubscriptionCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        sub = services.subscription_create(
            acting_user=request.user, organization=self.org, **body.validated_data)
        return Response(s.SubscriptionSerializer(sub).data, status=status.HTTP_201_CREATED)


class SubscriptionCancelApi(PlansOrgView):
    permission_for = {"POST": STAFF}

    @extend_schema(request=s.CancelSerializer, responses=s.SubscriptionSerializer)
    @idempotent
    def post(self, request: Request, org_id: str, sub_id: str) -> Response:
        body = s.CancelSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        sub = get_object_or_404(Subscription, organization=self.org, public_id=sub_id)
        sub = services.subscription_cancel(
            acting_user=request.user, subscription=sub, **body.validated_data)
        return Response(s.SubscriptionSerializer(sub).data)


class PackPurchaseListApi(PlansOrgView):
    permission_for = {"GET": "read", "POST": "org.write"}

    def current(self) -> Subscription:
        sub = selectors.subscription_at(organization=self.org)
        if sub is None:
            raise InvalidRequest("The organization has no subscription.", code="no_subscription")
        return sub

    @extend_schema(responses=s.PackPurchaseSerializer(many=True))
    def get(self, request: Request, org_id: str) -> Response:
        sub = selectors.subscription_at(organization=self.org)
        purchases = (sub.pack_purchases.select_related("pack").order_by("-purchased_at")
                     if sub else [])
        return Response({"object": "list",
                         "data": s.PackPurchaseSerializer(purchases, many=True).data})

    @extend_schema(request=s.PackPurchaseCreateSerializer,
                   responses={201: s.PackPurchaseSerializer},
                   description="Buy a credit pack of the current plan; billed on the next "
                               "invoice.")
    @idempotent
    def post(self, request: Request, org_id: str) -> Response:
        body = s.PackPurchaseCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        sub = self.current()
        pack = get_object_or_404(CreditPack, plan=sub.plan, code=body.validated_data["pack"])
        purchase = services.credit_pack_purchase(
            acting_user=request.user, subscription=sub, pack=pack)
        return Response(s.PackPurchaseSerializer(purchase).data, status=status.HTTP_201_CREATED)


class ReservationListApi(PlansOrgView):
    permission_for = {"GET": "read", "POST": STAFF}

    @extend_schema(responses=s.ReservationSerializer(many=True))
    def get(self, request: Request, org_id: str) -> Response:
        rows = selectors.reservations_of(organization=self.org).select_related("offering")
        return Response({"object": "list",
                         "data": s.ReservationSerializer(rows, many=True).data})

    @extend_schema(request=s.ReservationCreateSerializer,
                   responses={201: s.ReservationSerializer})
    @idempotent
    def post(self, request: Request, org_id: str) -> Response:
        body = s.ReservationCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        reservation = services.reservation_create(
            acting_user=request.user, organization=self.org, **body.validated_data)
        return Response(s.ReservationSerializer(reservation).data,
                        status=status.HTTP_201_CREATED)


class ReservationDetailApi(PlansOrgView):
    permission_for = {"GET": "read", "PATCH": STAFF}

    def reservation(self, reservation_id: str) -> Reservation:
        return get_object_or_404(Reservation.objects.select_related("offering"),
                                 organization=self.org, public_id=reservation_id)

    @extend_schema(responses=s.ReservationSerializer)
    def get(self, request: Request, org_id: str, reservation_id: str) -> Response:
        return Response(s.ReservationSerializer(self.reservation(reservation_id)).data)

    @extend_schema(request=s.ReservationUpdateSerializer, responses=s.ReservationSerializer)
    def patch(self, request: Request, org_id: str, reservation_id: str) -> Response:
        body = s.ReservationUpdateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        reservation = services.reservation_update(
            acting_user=request.user, reservation=self.reservation(reservation_id),
            **body.validated_data)
        return Response(s.ReservationSerializer(reservation).data)


class CreditGrantListApi(PlansOrgView):
    permission_for = {"GET": "billing.read", "POST": STAFF}

    @extend_schema(responses=s.CreditGrantSerializer(many=True),
                   description="Grants and the unexpired balance per currency.")
    def get(self, request: Request, org_id: str) -> Response:
        grants = selectors.credit_grants_of(organization=self.org)
        balance = selectors.credit_balance(organization=self.org)
        return Response({"object": "list",
                         "balance": {cur: str(v) for cur, v in balance.items()},
                         "data": s.CreditGrantSerializer(grants, many=True).data})

    @extend_schema(request=s.CreditGrantCreateSerializer,
                   responses={201: s.CreditGrantSerializer})
    @idempotent
    def post(self, request: Request, org_id: str) -> Response:
        body = s.CreditGrantCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        grant = services.credit_grant_create(
            acting_user=request.user, organization=self.org,
            created_by=cast(User, request.user),  # IsAuthenticated: a signed-in user
            **body.validated_data)
        return Response(s.CreditGrantSerializer(grant).data, status=status.HTTP_201_CREATED)


# --- quote -------------------------------------------------------------------------------------

class QuoteApi(APIView):
    """``POST /api/v1/pricing/quote``: price hypothetical token counts under the caller's plan."""

    @extend_schema(request=s.QuoteRequestSerializer, responses=s.QuoteSerializer)
    def post(self, request: Request) -> Response:
        body = s.QuoteRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = dict(body.validated_data)
        org = self._organization(request, data.pop("organization", None))
        rating = quote(org_id=org.pk, **data)
        return Response(s.QuoteSerializer({
            "model": data["model"], "currency": rating.currency, "amount": rating.amount,
            "breakdown": rating.breakdown, "credits_consumed": rating.credits_consumed,
            "normalized_tokens": rating.normalized_tokens,
            "capacity_source": rating.capacity_source, "rating_kind": rating.rating_kind,
            "price_version_id": rating.price_version_id,
        }).data)

    def _organization(self, request: Request, org_public_id: str | None) -> Organization:
        principal = getattr(request.user, "principal", None)
        if principal is not None:
            if org_public_id not in (None, principal.org_public_id):
                raise NotFound("No such organization.")
            return Organization.objects.get(pk=principal.org_id)
        if org_public_id is None:
            user = cast(User, request.user)  # IsAuthenticated: a signed-in user
            orgs = list(user.memberships.values_list("organization__public_id", flat=True)[:2])
            if len(orgs) != 1:
                raise InvalidRequest("Say which organization to quote for.",
                                     param="organization")
            org_public_id = orgs[0]
        if is_staff(request.user):
            org = Organization.objects.filter(public_id=org_public_id).first()
            if org is None:
                raise NotFound("No such organization.")
            return org
        return org_access(user=request.user, principal=None,
                          org_public_id=org_public_id).organization


# --- quotas: limits, budgets, audit ------------------------------------------------------------

class LimitsSerializer(drf_serializers.Serializer[Any]):
    usage_tier = drf_serializers.CharField(
        required=False, allow_blank=True, allow_null=True, default=None,
        help_text="Staff only (organization row): the usage tier; omit to keep it.")
    rpm = drf_serializers.IntegerField(required=False, allow_null=True, min_value=0,
                                       default=None)
    tpm = drf_serializers.IntegerField(required=False, allow_null=True, min_value=0,
                                       default=None)
    allowed_regions = drf_serializers.ListField(child=drf_serializers.CharField(max_length=40),
                                                required=False, default=list)


class BudgetWriteSerializer(drf_serializers.Serializer[Any]):
    amount = drf_serializers.DecimalField(max_digits=30, decimal_places=10,
                                          min_value=Decimal("0.0000000001"))
    hard = drf_serializers.BooleanField(default=True)
    thresholds = drf_serializers.ListField(child=drf_serializers.IntegerField(min_value=1,
                                                                              max_value=1000),
                                           required=False, min_length=1,
                                           max_length=quotas.MAX_THRESHOLDS)
    alert_emails = drf_serializers.ListField(child=drf_serializers.EmailField(max_length=254),
                                             required=False, default=list,
                                             max_length=quotas.MAX_ALERT_EMAILS)
    webhook_url = drf_serializers.URLField(
        required=False, allow_blank=True, default="", max_length=200,
        help_text="Receives a signed POST per threshold crossed (header Tollgate-Signature); "
                  "must resolve to public addresses only.")


class LimitsRowSerializer(drf_serializers.Serializer[Any]):
    """One scope's limits, as answered (``_limits_data``)."""

    object = drf_serializers.CharField(default="quota.limits")
    scope = drf_serializers.CharField()
    project = drf_serializers.CharField(allow_null=True)
    api_key = drf_serializers.CharField(allow_null=True)
    usage_tier = drf_serializers.CharField(allow_null=True)
    rpm = drf_serializers.IntegerField(allow_null=True)
    tpm = drf_serializers.IntegerField(allow_null=True)
    allowed_regions = drf_serializers.ListField(child=drf_serializers.CharField())


class LimitsOverviewSerializer(drf_serializers.Serializer[Any]):
    object = drf_serializers.CharField(default="quota.limits_overview")
    effective = drf_serializers.DictField(help_text="usage_tier, rpm, tpm in force")
    usage_tiers = drf_serializers.DictField(help_text="tier -> {rpm, tpm}")
    # a field called data (DRF takes declared fields off the class; the stubs see .data)
    data = LimitsRowSerializer(many=True)  # type: ignore[assignment]


class BudgetSerializer(drf_serializers.Serializer[Any]):
    """A budget and its state this period, as answered (``_budget_data``)."""

    object = drf_serializers.CharField(default="budget")
    id = drf_serializers.CharField()
    scope = drf_serializers.CharField()
    project = drf_serializers.CharField(allow_null=True)
    amount = drf_serializers.DecimalField(max_digits=30, decimal_places=10)
    currency = drf_serializers.CharField()
    hard = drf_serializers.BooleanField()
    thresholds = drf_serializers.ListField(child=drf_serializers.IntegerField())
    alert_emails = drf_serializers.ListField(child=drf_serializers.EmailField())
    webhook_url = drf_serializers.URLField(allow_null=True)
    suspended = drf_serializers.BooleanField()
    period_start = drf_serializers.DateTimeField()
    spend = drf_serializers.DecimalField(max_digits=30, decimal_places=10)
    reserved = drf_serializers.DecimalField(max_digits=30, decimal_places=10)
    percent_used = drf_serializers.DecimalField(max_digits=30, decimal_places=10)
    webhook_secret = drf_serializers.CharField(
        required=False, help_text="to members who may change the budget")


class QuotaAuditRowSerializer(drf_serializers.Serializer[Any]):
    action = drf_serializers.CharField()
    subject = drf_serializers.CharField()
    details = drf_serializers.JSONField(allow_null=True)
    created_at = drf_serializers.DateTimeField()


class ResidencyViolationSerializer(drf_serializers.Serializer[Any]):
    request_id = drf_serializers.CharField()
    organization_id = drf_serializers.IntegerField()
    region = drf_serializers.CharField()
    data_zone = drf_serializers.CharField()
    event_time = drf_serializers.DateTimeField()


def _limits_data(row: Any) -> dict[str, Any]:
    return {"object": "quota.limits", "scope": row.scope,
            "project": row.project.public_id if row.project_id else None,
            "api_key": row.api_key.public_id if row.api_key_id else None,
            "usage_tier": row.usage_tier or None, "rpm": row.rpm, "tpm": row.tpm,
            "allowed_regions": row.allowed_regions}


def _budget_data(budget: Any, *, with_secret: bool) -> dict[str, Any]:
    state = quotas.budget_state(budget=budget)
    data = {"object": "budget", "id": budget.public_id,
            "scope": "project" if budget.project_id else "organization",
            "project": budget.project.public_id if budget.project_id else None,
            "amount": str(budget.amount), "currency": budget.currency, "hard": budget.hard,
            "thresholds": budget.thresholds, "alert_emails": budget.alert_emails,
            "webhook_url": budget.webhook_url or None,
            "suspended": budget.suspended_at is not None,
            "period_start": state.period_start.isoformat(),
            "spend": str(state.live_spend), "reserved": str(state.reserved),
            "percent_used": str(state.percent)}
    if with_secret:
        data["webhook_secret"] = budget.webhook_secret
    return data


class OrgLimitsApi(PlansOrgView):
    """GET the effective org limits and every project/key override; PUT the org's own.

    Members with ``org.write`` set rpm/tpm up to their tier's ceiling; the tier itself is set
    by Tollgate staff (who reach every organization here, or use the Django admin).
    """

    permission_for = {"GET": "read", "PUT": "org.write"}

    @extend_schema(responses=LimitsOverviewSerializer)
    def get(self, request: Request, org_id: str) -> Response:
        rows = limits.limits_rows_of(organization=self.org)
        org_row = next((r for r in rows if r.scope == "organization"), None)
        tier = (org_row.usage_tier if org_row and org_row.usage_tier
                else limits.DEFAULT_USAGE_TIER)
        rpm, tpm = limits.USAGE_TIERS[tier]
        effective = {"usage_tier": tier,
                     "rpm": org_row.rpm if org_row and org_row.rpm is not None else rpm,
                     "tpm": org_row.tpm if org_row and org_row.tpm is not None else tpm}
        return Response({"object": "quota.limits_overview", "effective": effective,
                         "usage_tiers": {k: {"rpm": v[0], "tpm": v[1]}
                                         for k, v in limits.USAGE_TIERS.items()},
                         "data": [_limits_data(r) for r in rows]})

    @extend_schema(request=LimitsSerializer, responses=LimitsRowSerializer)
    def put(self, request: Request, org_id: str) -> Response:
        body = LimitsSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        row = limits.quota_limit_set(organization=self.org, acting_user=request.user,
                                     **body.validated_data)
        return Response(_limits_data(row))


class ProjectLimitsApi(OrgScopedView):
    permission_for = {"PUT": "projects.write", "DELETE": "projects.write"}

    @extend_schema(request=LimitsSerializer, responses=LimitsRowSerializer)
    def put(self, request: Request, org_id: str, project_id: str) -> Response:
        body = LimitsSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        if body.validated_data.get("usage_tier"):
            raise InvalidRequest("A usage tier is set on the organization only.",
                                 param="usage_tier")
        body.validated_data.pop("usage_tier", None)
        row = limits.quota_limit_set(organization=self.org, project=self.project(project_id),
                                     acting_user=request.user, **body.validated_data)
        return Response(_limits_data(row))

    @extend_schema(responses={204: None})
    def delete(self, request: Request, org_id: str, project_id: str) -> Response:
        limits.quota_limit_delete(organization=self.org, project=self.project(project_id),
                                  acting_user=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)


class KeyLimitsApi(OrgScopedView):
    permission_for = {"PUT": "keys.write", "DELETE": "keys.write"}

    def key(self, project_id: str, key_id: str) -> ApiKey:
        return get_object_or_404(ApiKey, project=self.project(project_id), public_id=key_id)

    @extend_schema(request=LimitsSerializer, responses=LimitsRowSerializer)
    def put(self, request: Request, org_id: str, project_id: str, key_id: str) -> Response:
        body = LimitsSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        if body.validated_data.pop("usage_tier", None):
            raise InvalidRequest("A usage tier is set on the organization only.",
                                 param="usage_tier")
        row = limits.quota_limit_set(organization=self.org, api_key=self.key(project_id, key_id),
                                     acting_user=request.user, **body.validated_data)
        return Response(_limits_data(row))

    @extend_schema(responses={204: None})
    def delete(self, request: Request, org_id: str, project_id: str, key_id: str) -> Response:
        limits.quota_limit_delete(organization=self.org, api_key=self.key(project_id, key_id),
                                  acting_user=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)


class BudgetApi(OrgScopedView):
    """The org's budget (no ``project_id``) or a project's: GET, PUT (create/replace), DELETE."""

    permission_for = {"GET": "read", "PUT": "org.write", "DELETE": "org.write"}

    def _project(self, project_id: str | None) -> Any:
        return self.project(project_id) if project_id else None

    def _budget(self, project_id: str | None) -> Budget:
        budget = Budget.objects.select_related("project").filter(
            organization=self.org, project=self._project(project_id)).first()
        if budget is None:
            raise NotFound("No budget is set here.")
        return budget

    @extend_schema(responses=BudgetSerializer)
    def get(self, request: Request, org_id: str, project_id: str | None = None) -> Response:
        return Response(_budget_data(self._budget(project_id),
                                     with_secret=self.access.can("org.write")))

    @extend_schema(request=BudgetWriteSerializer, responses=BudgetSerializer)
    def put(self, request: Request, org_id: str, project_id: str | None = None) -> Response:
        body = BudgetWriteSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        budget = quotas.budget_set(organization=self.org, project=self._project(project_id),
                                   actor=request.user, **body.validated_data)
        return Response(_budget_data(budget, with_secret=True))

    @extend_schema(responses={204: None})
    def delete(self, request: Request, org_id: str, project_id: str | None = None) -> Response:
        quotas.budget_delete(budget=self._budget(project_id), actor=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)


class _TextField(drf_serializers.CharField):
    """A string as sent: a number is not an end user's name (DRF would make 7 into "7")."""

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class EndUserBudgetWriteSerializer(drf_serializers.Serializer[Any]):
    end_user = _TextField(
        allow_null=True, max_length=256, trim_whitespace=False,
        help_text="The end user as requests name it in `user` (or Anthropic's "
                  "metadata.user_id); null: the default for each end user without its own.")
    amount = drf_serializers.DecimalField(max_digits=30, decimal_places=10,
                                          min_value=Decimal("0.0000000001"))


class EndUserBudgetSerializer(drf_serializers.Serializer[Any]):
    """An end-user budget and, for a named end user, its spend this month."""

    object = drf_serializers.CharField(default="end_user_budget")
    id = drf_serializers.CharField()
    end_user = drf_serializers.CharField(allow_null=True)
    amount = drf_serializers.DecimalField(max_digits=30, decimal_places=10)
    currency = drf_serializers.CharField()
    period_start = drf_serializers.DateTimeField()
    spend = drf_serializers.DecimalField(max_digits=30, decimal_places=10, allow_null=True)
    updated_at = drf_serializers.DateTimeField()


def _end_user_budget_data(budget: EndUserBudget) -> dict[str, Any]:
    spend = quotas.end_user_spend_now(budget=budget)
    return {"object": "end_user_budget", "id": budget.public_id, "end_user": budget.end_user,
            "amount": str(budget.amount), "currency": budget.currency,
            "period_start": month_bounds(timezone.now())[0].isoformat(),
            "spend": None if spend is None else str(spend),
            "updated_at": budget.updated_at.isoformat()}


class EndUserBudgetListApi(PlansOrgView):
    """Hard monthly budgets per end user (the ``user`` of a request): GET lists them (the
    default first; ``end_user`` narrows to one, ``limit`` 1-100 and ``after`` an id page the
    rest); PUT creates or replaces one (``end_user`` null: the default for each end user)."""

    permission_for = {"GET": "read", "PUT": "org.write"}

    @extend_schema(responses=EndUserBudgetSerializer(many=True))
    def get(self, request: Request, org_id: str) -> Response:
        limit_text = request.query_params.get("limit", "20")
        if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
            raise InvalidRequest("'limit' must be an integer from 1 to 100.", param="limit")
        rows = quotas.end_user_budgets_of(organization=self.org,
                                          end_user=request.query_params.get("end_user"))
        after = request.query_params.get("after")
        if after is not None:
            anchor = rows.filter(public_id=after).first()
            if anchor is None:
                raise InvalidRequest("'after' is not an end-user budget of this organization.",
                                     param="after")
            rows = rows.filter(end_user__isnull=False)  # the default comes first
            if anchor.end_user is not None:
                rows = rows.filter(id__gt=anchor.id)
        page = list(rows[:int(limit_text) + 1])
        more = len(page) > int(limit_text)
        page = page[:int(limit_text)]
        return Response({"object": "list", "data": [_end_user_budget_data(b) for b in page],
                         "has_more": more, "last_id": page[-1].public_id if page else None})

    @extend_schema(request=EndUserBudgetWriteSerializer, responses=EndUserBudgetSerializer)
    def put(self, request: Request, org_id: str) -> Response:
        body = EndUserBudgetWriteSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        budget = quotas.end_user_budget_set(organization=self.org,
                                            acting_user=request.user, **body.validated_data)
        return Response(_end_user_budget_data(budget))


class EndUserBudgetDetailApi(PlansOrgView):
    """One end-user budget: GET, DELETE (that end user falls back to the default)."""

    permission_for = {"GET": "read", "DELETE": "org.write"}

    def _budget(self, budget_id: str) -> EndUserBudget:
        return get_object_or_404(EndUserBudget, organization=self.org, public_id=budget_id)

    @extend_schema(responses=EndUserBudgetSerializer)
    def get(self, request: Request, org_id: str, budget_id: str) -> Response:
        return Response(_end_user_budget_data(self._budget(budget_id)))

    @extend_schema(responses={204: None})
    def delete(self, request: Request, org_id: str, budget_id: str) -> Response:
        quotas.end_user_budget_delete(budget=self._budget(budget_id), acting_user=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)


class QuotaAuditApi(OrgScopedView):
    """The quota part of the audit log (limits, budgets, suspensions, alerts), as before the
    audit log existed; the whole log is ``/api/v1/organizations/{org}/audit_log/``."""

    permission_for = {"GET": "read"}

    @extend_schema(responses=QuotaAuditRowSerializer(many=True))
    def get(self, request: Request, org_id: str) -> Response:
        rows = quota_audit_events(organization=self.org)[:200]
        return Response({"object": "list", "data": [
            {"action": r.action, "subject": r.target, "details": r.after,
             "created_at": r.created_at.isoformat()} for r in rows]})


class ResidencyAuditApi(APIView):
    """Staff only: usage events that ran outside their organization's data zone (expect none)."""

    @extend_schema(responses=ResidencyViolationSerializer(many=True))
    def get(self, request: Request) -> Response:
        if not is_staff(request.user):
            raise exceptions.PermissionDenied("Only Tollgate staff can read this.")
        rows = selectors.usage_events_outside_zone()
        return Response({"object": "list", "data": rows})
