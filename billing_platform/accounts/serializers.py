"""Wire shapes of the management API. Validation only: no business logic here."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from rest_framework import serializers

from billing_platform.accounts.billing_profile import max_length
from billing_platform.accounts.choices import DataZone, Role, Scope
from billing_platform.accounts.models import ApiKey, Invitation, Membership, Organization, Project


class OrganizationSerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="public_id", read_only=True)
    role = serializers.SerializerMethodField()

    class Meta:
        model = Organization
        fields = ["id", "name", "slug", "billing_email", "currency", "data_zone", "tax_rate",
                  "status", "role", "created_at"]
        read_only_fields = ["slug", "currency", "tax_rate", "status", "created_at"]

    def get_role(self, org: Organization) -> str | None:
        return self.context.get("roles", {}).get(org.pk)


class OrganizationUpdateSerializer(serializers.Serializer):
    # billing_email is part of the billing profile (owners only): BillingProfileUpdateSerializer
    name = serializers.CharField(max_length=200, required=False)
    data_zone = serializers.ChoiceField(choices=DataZone.choices, required=False)


class BillingProfileSerializer(serializers.ModelSerializer):
    object = serializers.SerializerMethodField()
    organization = serializers.CharField(source="public_id", read_only=True)
    editable = serializers.SerializerMethodField(
        help_text="The fields the caller may change (context ``editable``).")

    class Meta:
        model = Organization
        fields = ["object", "organization", "legal_name", "address_line1", "address_line2",
                  "postal_code", "city", "region", "country", "tax_id", "billing_email",
                  "currency", "tax_rate", "editable"]
        read_only_fields = fields

    def get_object(self, org: Organization) -> str:
        return "billing_profile"

    def get_editable(self, org: Organization) -> list[str]:
        return list(self.context.get("editable", ()))


def _profile_text(name: str) -> serializers.CharField:
    return serializers.CharField(required=False, allow_blank=True, trim_whitespace=False,
                                 max_length=max_length(name))


class BillingProfileUpdateSerializer(serializers.Serializer):
    """A change to the billing profile: any of its fields; a field not in it is an error.

    Shapes only; what a value must be (a country code, a tax id, a priced currency) and who
    may set it is ``accounts.billing_profile``'s.
    """

    legal_name = _profile_text("legal_name")
    address_line1 = _profile_text("address_line1")
    address_line2 = _profile_text("address_line2")
    postal_code = _profile_text("postal_code")
    city = _profile_text("city")
    region = _profile_text("region")
    country = _profile_text("country")
    tax_id = _profile_text("tax_id")
    billing_email = serializers.EmailField(required=False, max_length=254)
    currency = serializers.CharField(required=False, min_length=3, max_length=3)
    tax_rate = serializers.DecimalField(required=False, max_digits=5, decimal_places=4,
                                        min_value=Decimal("0"), max_value=Decimal("0.9999"))

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(self.fields))
            if unknown:
                raise serializers.ValidationError(
                    {str(key)[:64]: ["Not a field of the billing profile."]
                     for key in unknown[:10]})
        return super().to_internal_value(data)


class ProjectSerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="public_id", read_only=True)

    class Meta:
        model = Project
        fields = ["id", "name", "status", "created_at"]
        read_only_fields = ["status", "created_at"]


class ApiKeySerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="public_id", read_only=True)
    project = serializers.CharField(source="project.public_id", read_only=True)
    redacted_value = serializers.CharField(source="redacted", read_only=True)

    class Meta:
        model = ApiKey
        fields = ["id", "name", "project", "prefix", "redacted_value", "scopes",
                  "allowed_models", "expires_at", "revoked_at", "last_used_at", "created_at"]


class ApiKeyCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=200)
    scopes = serializers.ListField(
        child=serializers.ChoiceField(choices=Scope.choices), default=[Scope.INFERENCE],
        allow_empty=False,
    )
    allowed_models = serializers.ListField(
        child=serializers.CharField(max_length=200), default=list
    )
    expires_at = serializers.DateTimeField(required=False, allow_null=True, default=None)


class ApiKeyCreatedSerializer(ApiKeySerializer):
    secret = serializers.CharField(read_only=True, help_text="Shown once; store it now.")

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "secret"]


class MemberSerializer(serializers.ModelSerializer):
    email = serializers.EmailField(source="user.email", read_only=True)

    class Meta:
        model = Membership
        fields = ["id", "email", "role", "created_at"]
        read_only_fields = ["id", "created_at"]


class RoleSerializer(serializers.Serializer):
    role = serializers.ChoiceField(choices=Role.choices)


class InviteSerializer(serializers.Serializer):
    email = serializers.EmailField()
    role = serializers.ChoiceField(choices=Role.choices, default=Role.DEVELOPER)


class InvitationSerializer(serializers.ModelSerializer):
    class Meta:
        model = Invitation
        fields = ["id", "email", "role", "created_at", "expires_at", "accepted_at"]
