"""Wire shapes of the plans API. Validation only; money always travels as decimal strings."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django.utils import timezone
from rest_framework import serializers

from plans.advisor import MAX_PERIOD
from plans.choices import (
    CapacitySource,
    CapPolicy,
    CreditGrantKind,
    OverflowPolicy,
    PlanKind,
    ReservationTerm,
    ServiceTier,
    TokenClass,
)
from plans.models import (
    ContextBand,
    CreditCoefficient,
    CreditGrant,
    CreditPack,
    CreditPackPurchase,
    ModelPrice,
    Plan,
    PriceBook,
    PriceMultiplier,
    PriceVersion,
    ProvisionedOffering,
    Reservation,
    Subscription,
)


def _price(**kwargs: Any) -> serializers.DecimalField:
    return serializers.DecimalField(max_digits=24, decimal_places=10, min_value=Decimal("0"),
                                    **kwargs)


def _money(**kwargs: Any) -> serializers.DecimalField:
    return serializers.DecimalField(max_digits=30, decimal_places=10, min_value=Decimal("0"),
                                    **kwargs)


def _credits(**kwargs: Any) -> serializers.DecimalField:
    return serializers.DecimalField(max_digits=30, decimal_places=6, min_value=Decimal("0"),
                                    **kwargs)


def _factor(**kwargs: Any) -> serializers.DecimalField:
    return serializers.DecimalField(max_digits=14, decimal_places=6, min_value=Decimal("0"),
                                    **kwargs)


# --- price books -------------------------------------------------------------------------------

class ContextBandSerializer(serializers.ModelSerializer):
    input = _price()
    cached_input = _price(required=False, allow_null=True, default=None)
    output = _price()
    cache_write = _price(required=False, allow_null=True, default=None)

    class Meta:
        model = ContextBand
        fields = ["above_prompt_tokens", "input", "cached_input", "output", "cache_write"]


class ModelPriceSerializer(serializers.ModelSerializer):
    input = _price()
    cached_input = _price(required=False, allow_null=True, default=None,
                          help_text="Empty: 0.1 x input.")
    output = _price()
    cache_write = _price(required=False, allow_null=True, default=None)
    bands = ContextBandSerializer(many=True, required=False, default=list)

    class Meta:
        model = ModelPrice
        fields = ["model", "input", "cached_input", "output", "cache_write", "bands"]
        # Uniqueness is per version, checked by the database; a body has no version yet.
        validators: list = []


class PriceVersionSerializer(serializers.ModelSerializer):
    prices = ModelPriceSerializer(many=True, read_only=True)
    tier_multipliers = serializers.SerializerMethodField()
    zone_multipliers = serializers.SerializerMethodField()

    class Meta:
        model = PriceVersion
        fields = ["id", "effective_from", "note", "prices", "tier_multipliers",
                  "zone_multipliers", "created_at"]

    def _mults(self, version: PriceVersion, dimension: str) -> dict[str, str]:
        rows: list[PriceMultiplier] = list(version.multipliers.all())
        return {m.key: str(m.factor) for m in rows if m.dimension == dimension}

    def get_tier_multipliers(self, version: PriceVersion) -> dict[str, str]:
        return self._mults(version, "tier")

    def get_zone_multipliers(self, version: PriceVersion) -> dict[str, str]:
        return self._mults(version, "zone")


class PriceVersionCreateSerializer(serializers.Serializer):
    effective_from = serializers.DateTimeField()
    note = serializers.CharField(max_length=500, required=False, default="")
    prices = ModelPriceSerializer(many=True, required=False, default=list)
    remove_models = serializers.ListField(child=serializers.CharField(max_length=200),
                                          required=False, default=list)
    tier_multipliers = serializers.DictField(child=_factor(), required=False, default=dict)
    zone_multipliers = serializers.DictField(child=_factor(), required=False, default=dict)


class PriceBookSerializer(serializers.ModelSerializer):
    class Meta:
        model = PriceBook
        fields = ["code", "name", "currency", "is_default", "created_at"]
        read_only_fields = ["created_at"]


# --- plans -------------------------------------------------------------------------------------

class CoefficientSerializer(serializers.ModelSerializer):
    model = serializers.CharField(max_length=200, default="*")
    token_class = serializers.ChoiceField(choices=TokenClass.choices)
    coefficient = _factor()

    class Meta:
        model = CreditCoefficient
        fields = ["model", "token_class", "coefficient"]
        validators: list = []


class CreditPackSerializer(serializers.ModelSerializer):
    credits = _credits()
    price = _money()

    class Meta:
        model = CreditPack
        fields = ["code", "name", "credits", "price", "validity_days", "is_active"]


class PlanSerializer(serializers.ModelSerializer):
    price_book = serializers.SlugRelatedField(
        slug_field="code", queryset=PriceBook.objects.all(), required=False, allow_null=True)
    monthly_fee = _money(default=Decimal("0"))
    credits_per_period = _credits(required=False, allow_null=True, default=None)
    window_credits = _credits(required=False, allow_null=True, default=None)
    kind = serializers.ChoiceField(choices=PlanKind.choices)
    cap_policy = serializers.ChoiceField(choices=CapPolicy.choices, default=CapPolicy.BLOCK)
    coefficients = CoefficientSerializer(many=True, required=False, default=list)
    credit_packs = CreditPackSerializer(many=True, read_only=True)

    class Meta:
        model = Plan
        fields = ["code", "name", "kind", "currency", "price_book", "description", "monthly_fee",
                  "credits_per_period", "window_credits", "window_hours", "cap_policy",
                  "coefficients", "credit_packs", "is_public", "is_active", "created_at"]
        read_only_fields = ["created_at", "is_active"]


class PlanUpdateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=200, required=False)
    description = serializers.CharField(required=False, allow_blank=True)
    monthly_fee = _money(required=False)
    credits_per_period = _credits(required=False, allow_null=True)
    window_credits = _credits(required=False, allow_null=True)
    # the column's bound (a PositiveSmallIntegerField), as PlanSerializer reads it off the model
    window_hours = serializers.IntegerField(min_value=1, max_value=32767, required=False)
    cap_policy = serializers.ChoiceField(choices=CapPolicy.choices, required=False)
    is_public = serializers.BooleanField(required=False)
    is_active = serializers.BooleanField(required=False)
    coefficients = CoefficientSerializer(many=True, required=False)


class CreditPackCreateSerializer(serializers.Serializer):
    code = serializers.SlugField(max_length=60)
    name = serializers.CharField(max_length=200)
    credits = _credits()
    price = _money()
    validity_days = serializers.IntegerField(min_value=1, required=False, allow_null=True,
                                             default=None)


class ProvisionedOfferingSerializer(serializers.ModelSerializer):
    cache_burndown = _factor(default=Decimal("0"))
    output_burndown = _factor(default=Decimal("1"))
    hourly_unit_price = _money()
    monthly_unit_price = _money()

    class Meta:
        model = ProvisionedOffering
        fields = ["code", "name", "model", "region", "currency", "tokens_per_minute_per_unit",
                  "cache_burndown", "output_burndown", "hourly_unit_price",
                  "monthly_unit_price", "min_units", "is_active"]


# --- what a customer holds ---------------------------------------------------------------------

class SubscriptionSerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="public_id", read_only=True)
    plan = serializers.CharField(source="plan.code", read_only=True)
    plan_kind = serializers.CharField(source="plan.kind", read_only=True)
    monthly_fee = serializers.DecimalField(source="plan.monthly_fee", max_digits=30,
                                           decimal_places=10, read_only=True)
    currency = serializers.CharField(source="plan.currency", read_only=True)

    class Meta:
        model = Subscription
        fields = ["id", "plan", "plan_kind", "currency", "monthly_fee", "starts_at", "ends_at",
                  "billing_anchor", "data_zone", "created_at"]


class SubscriptionCreateSerializer(serializers.Serializer):
    plan = serializers.SlugRelatedField(slug_field="code", queryset=Plan.objects.all())
    starts_at = serializers.DateTimeField(required=False, default=None)
    ends_at = serializers.DateTimeField(required=False, allow_null=True, default=None)
    billing_anchor = serializers.DateTimeField(required=False, allow_null=True, default=None)
    data_zone = serializers.CharField(max_length=16, required=False, allow_null=True,
                                      default=None)


class CancelSerializer(serializers.Serializer):
    at = serializers.DateTimeField(required=False, allow_null=True, default=None)


class TokenPlanStatusSerializer(serializers.Serializer):
    period_start = serializers.DateTimeField()
    period_end = serializers.DateTimeField()
    period_credits = _credits()
    period_used = _credits()
    window_hours = serializers.IntegerField()
    window_credits = _credits(allow_null=True)
    window_used = _credits()
    window_frees_at = serializers.DateTimeField(allow_null=True)
    pack_credits_left = _credits()
    plan_credits_left = _credits()
    credits_left = _credits()
    overage_credits = _credits()
    cap_policy = serializers.CharField()


class PackPurchaseSerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="public_id", read_only=True)
    pack = serializers.CharField(source="pack.code", read_only=True, allow_null=True)
    credits_left = _credits(read_only=True)

    class Meta:
        model = CreditPackPurchase
        fields = ["id", "pack", "credits", "credits_used", "credits_left", "price", "currency",
                  "purchased_at", "expires_at"]


class PackPurchaseCreateSerializer(serializers.Serializer):
    pack = serializers.SlugField(max_length=60)


class ReservationSerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="public_id", read_only=True)
    offering = serializers.CharField(source="offering.code", read_only=True)
    tokens_per_minute = serializers.IntegerField(read_only=True)
    fee = _money(read_only=True)

    class Meta:
        model = Reservation
        fields = ["id", "offering", "model", "region", "units", "term", "term_count",
                  "unit_price", "currency", "fee", "tokens_per_minute_per_unit",
                  "tokens_per_minute", "cache_burndown", "output_burndown", "overflow_policy",
                  "starts_at", "ends_at", "created_at"]


class ReservationCreateSerializer(serializers.Serializer):
    offering = serializers.SlugRelatedField(slug_field="code",
                                            queryset=ProvisionedOffering.objects.all())
    units = serializers.IntegerField(min_value=1)
    term = serializers.ChoiceField(choices=ReservationTerm.choices)
    term_count = serializers.IntegerField(min_value=1, default=1)
    starts_at = serializers.DateTimeField(required=False, default=None)
    overflow_policy = serializers.ChoiceField(choices=OverflowPolicy.choices,
                                              default=OverflowPolicy.SPILLOVER)


class ReservationUpdateSerializer(serializers.Serializer):
    overflow_policy = serializers.ChoiceField(choices=OverflowPolicy.choices, required=False)
    ends_at = serializers.DateTimeField(required=False)


class CreditGrantSerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="public_id", read_only=True)

    class Meta:
        model = CreditGrant
        fields = ["id", "kind", "currency", "amount", "remaining", "granted_at", "expires_at",
                  "note"]


class CreditGrantCreateSerializer(serializers.Serializer):
    kind = serializers.ChoiceField(choices=CreditGrantKind.choices)
    amount = _money()
    currency = serializers.CharField(max_length=3, required=False, default=None)
    expires_at = serializers.DateTimeField(required=False, allow_null=True, default=None)
    note = serializers.CharField(max_length=500, required=False, default="")


# --- quote -------------------------------------------------------------------------------------

class QuoteRequestSerializer(serializers.Serializer):
    organization = serializers.CharField(
        max_length=40, required=False, help_text="Organization id; implied by an API key.")
    model = serializers.CharField(max_length=200)
    prompt_tokens = serializers.IntegerField(min_value=0)
    cached_tokens = serializers.IntegerField(min_value=0, default=0)
    completion_tokens = serializers.IntegerField(min_value=0, default=0)
    cache_write_tokens = serializers.IntegerField(min_value=0, default=0)
    service_tier = serializers.ChoiceField(choices=ServiceTier.choices,
                                           default=ServiceTier.DEFAULT)
    capacity_source = serializers.ChoiceField(
        choices=[CapacitySource.ON_DEMAND, CapacitySource.PROVISIONED, CapacitySource.SPILLOVER,
                 CapacitySource.PLAN], default=CapacitySource.ON_DEMAND)
    region = serializers.CharField(max_length=40, required=False, default="")
    data_zone = serializers.CharField(max_length=16, required=False, default=None)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs["cached_tokens"] + attrs["cache_write_tokens"] > attrs["prompt_tokens"]:
            raise serializers.ValidationError(
                {"cached_tokens": "cached + cache-write tokens cannot exceed prompt_tokens"})
        return attrs


class QuoteSerializer(serializers.Serializer):
    object = serializers.CharField(default="pricing.quote")
    model = serializers.CharField()
    currency = serializers.CharField()
    amount = serializers.DecimalField(max_digits=30, decimal_places=10)
    breakdown = serializers.DictField(
        child=serializers.DecimalField(max_digits=30, decimal_places=10))
    credits_consumed = _credits()
    normalized_tokens = serializers.IntegerField()
    capacity_source = serializers.CharField()
    rating_kind = serializers.CharField()
    price_version_id = serializers.IntegerField(allow_null=True)


# --- plan advice -------------------------------------------------------------------------------

class PlanAdviceQuerySerializer(serializers.Serializer):
    """``start`` and ``end`` of a past period (ISO 8601, aware), both or neither: neither means
    the organization's last closed billing period. At most ``plans.advisor.MAX_PERIOD``."""

    start = serializers.DateTimeField(required=False,
                                      help_text="inclusive, e.g. 2026-10-01T00:00:00Z")
    end = serializers.DateTimeField(required=False, help_text="exclusive, in the past")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        start, end = attrs.get("start"), attrs.get("end")
        if (start is None) != (end is None):
            raise serializers.ValidationError(
                {"end" if end is None else "start": "Give both start and end, or neither."})
        if start is not None and end is not None:
            if start >= end:
                raise serializers.ValidationError({"end": "end must be after start."})
            if end - start > MAX_PERIOD:
                raise serializers.ValidationError(
                    {"end": f"A period is at most {MAX_PERIOD.days} days."})
            if end > timezone.now():
                raise serializers.ValidationError({"end": "The period must have ended."})
        return attrs


class AdviceLineSerializer(serializers.Serializer):
    model = serializers.CharField()
    region = serializers.CharField()
    service_tier = serializers.CharField()
    capacity_source = serializers.CharField()
    token_class = serializers.CharField()
    tokens = serializers.IntegerField()
    amount_precise = serializers.DecimalField(max_digits=30, decimal_places=10)
    amount = serializers.DecimalField(max_digits=30, decimal_places=4)


class AlternativeSerializer(serializers.Serializer):
    kind = serializers.CharField()
    code = serializers.CharField()
    name = serializers.CharField()
    available = serializers.BooleanField()
    reason = serializers.CharField()
    usage = serializers.DecimalField(max_digits=30, decimal_places=4)
    fees = serializers.DecimalField(max_digits=30, decimal_places=4)
    total = serializers.DecimalField(max_digits=30, decimal_places=4)
    requests = serializers.IntegerField()
    refused_requests = serializers.IntegerField()
    detail = serializers.SerializerMethodField()
    lines = AdviceLineSerializer(many=True)

    def get_detail(self, obj: Any) -> dict[str, Any]:
        # money and credits as decimal strings, like every amount of this API
        return {k: str(v) if isinstance(v, Decimal) else v for k, v in obj.detail.items()}


class PlanAdviceSerializer(serializers.Serializer):
    object = serializers.SerializerMethodField()
    organization = serializers.CharField()
    period_start = serializers.DateTimeField()
    period_end = serializers.DateTimeField()
    currency = serializers.CharField()
    events = serializers.IntegerField()
    current = AlternativeSerializer()
    alternatives = AlternativeSerializer(many=True)
    cheapest = serializers.SerializerMethodField()
    saving = serializers.DecimalField(max_digits=30, decimal_places=4)

    def get_object(self, obj: Any) -> str:
        return "plan_advice"

    def get_cheapest(self, obj: Any) -> dict[str, Any]:
        c = obj.cheapest
        return {"kind": c.kind, "code": c.code, "name": c.name, "total": str(c.total)}
