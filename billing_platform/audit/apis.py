"""``/api/v1`` audit log: an organization's owners and admins read their org's rows, platform
staff read every row. Read-only: there is no write endpoint, by design."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import exceptions, serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from billing_platform.accounts.models import Organization
from billing_platform.api.views import OrgScopedView
from billing_platform.audit import selectors
from billing_platform.audit.models import AuditEvent

MAX_LIMIT = 500


class AuditEventSerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="public_id")
    organization = serializers.SerializerMethodField()
    actor = serializers.SerializerMethodField()

    class Meta:
        model = AuditEvent
        fields = ["id", "organization", "actor", "action", "target", "before", "after",
                  "request_id", "created_at"]

    def get_organization(self, row: AuditEvent) -> str | None:
        return self.context["org_ids"].get(row.organization_id)

    def get_actor(self, row: AuditEvent) -> dict[str, Any]:
        return {"type": row.actor_kind, "label": row.actor_label}


class AuditQuerySerializer(serializers.Serializer):
    action = serializers.CharField(required=False, max_length=60)
    target = serializers.CharField(required=False, max_length=80)
    actor = serializers.CharField(required=False, max_length=200)
    since = serializers.DateTimeField(required=False)
    until = serializers.DateTimeField(required=False)
    after = serializers.CharField(required=False, max_length=40,
                                  help_text="cursor: the last id of the previous page")
    limit = serializers.IntegerField(required=False, min_value=1, max_value=MAX_LIMIT,
                                     default=100)


_PARAMS = [OpenApiParameter(n, str, description=d) for n, d in (
    ("action", "prefix of the action, e.g. api_key."), ("target", "public id acted on"),
    ("actor", "email or api-key:<prefix>"), ("since", "ISO time, inclusive"),
    ("until", "ISO time, exclusive"), ("after", "cursor from the previous page"),
    ("limit", f"1-{MAX_LIMIT}, default 100"))]


def _page(request: Request, organization: Organization | None) -> Response:
    query = AuditQuerySerializer(data=request.query_params)
    query.is_valid(raise_exception=True)
    q = dict(query.validated_data)
    limit, after = q.pop("limit"), q.pop("after", None)
    rows = selectors.audit_events(organization=organization, **q)
    if after:
        anchor = rows.filter(public_id=after).values_list("id", flat=True).first()
        if anchor is None:
            raise exceptions.ValidationError({"after": ["No such audit event in this list."]})
        rows = rows.filter(id__lt=anchor)
    page = list(rows[:limit + 1])
    more, page = len(page) > limit, page[:limit]
    org_ids = dict(Organization.objects.filter(
        pk__in={r.organization_id for r in page}).values_list("pk", "public_id"))
    data = AuditEventSerializer(page, many=True, context={"org_ids": org_ids}).data
    return Response({"object": "list", "data": data, "has_more": more,
                     "last_id": page[-1].public_id if page else None})


class OrgAuditLogApi(OrgScopedView):
    """An organization's audit log (owners and admins)."""

    permission_for = {"GET": "audit.read"}

    @extend_schema(parameters=_PARAMS, responses=AuditEventSerializer(many=True))
    def get(self, request: Request, org_id: str) -> Response:
        return _page(request, self.org)


class PlatformAuditLogApi(APIView):
    """Every organization's audit log and the platform's own actions (staff only)."""

    @extend_schema(parameters=_PARAMS, responses=AuditEventSerializer(many=True))
    def get(self, request: Request) -> Response:
        if not getattr(request.user, "is_staff", False) or hasattr(request.user, "principal"):
            raise exceptions.PermissionDenied("Only Tollgate staff can read the whole log.")
        return _page(request, None)
