"""Wire shapes of the management API. Validation only: no business logic here."""

from __future__ import annotations

from rest_framework import serializers

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
    name = serializers.CharField(max_length=200, required=False)
    billing_email = serializers.EmailField(required=False)
    data_zone = serializers.ChoiceField(choices=DataZone.choices, required=False)


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
