"""Management API views (/api/v1/): thin — validate, call one service, serialize.

Every object is looked up inside the caller's organization (``api.views.OrgScopedView``), so
another organization's object is a 404, never a 403 that would confirm it exists. Role rules
come from ``ROLE_PERMISSIONS``; domain errors are answered by ``api.errors``.
"""

from __future__ import annotations

from typing import Any, cast

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema
from rest_framework import exceptions, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from billing_platform.accounts import billing_profile, services
from billing_platform.accounts import serializers as s
from billing_platform.accounts.choices import Role
from billing_platform.accounts.models import ApiKey, Membership, Organization, User
from billing_platform.accounts.selectors import (
    OrgAccess,
    api_keys_for_project,
    org_access,
    organizations_for_user,
)
from billing_platform.api.views import OrgScopedView


class OrganizationListApi(APIView):
    @extend_schema(responses=s.OrganizationSerializer(many=True))
    def get(self, request: Request) -> Response:
        principal = getattr(request.user, "principal", None)
        if principal is not None:
            access = org_access(user=None, principal=principal,
                                org_public_id=principal.org_public_id)
            orgs, roles = [access.organization], {access.organization.pk: access.role}
        else:
            user = cast(User, request.user)  # IsAuthenticated, and not an API key: a person
            orgs = list(organizations_for_user(user=user))
            roles = dict(user.memberships.values_list("organization_id", "role"))
        data = s.OrganizationSerializer(orgs, many=True, context={"roles": roles}).data
        return Response({"object": "list", "data": data})


class OrganizationDetailApi(OrgScopedView):
    permission_for = {"GET": "read", "PATCH": "org.write"}

    @extend_schema(responses=s.OrganizationSerializer)
    def get(self, request: Request, org_id: str) -> Response:
        ctx = {"roles": {self.org.pk: self.access.role}}
        return Response(s.OrganizationSerializer(self.org, context=ctx).data)

    @extend_schema(request=s.OrganizationUpdateSerializer, responses=s.OrganizationSerializer)
    def patch(self, request: Request, org_id: str) -> Response:
        body = s.OrganizationUpdateSerializer(data=request.data, partial=True)
        body.is_valid(raise_exception=True)
        org = services.organization_update(organization=self.org, acting_user=request.user,
                                           **body.validated_data)
        ctx = {"roles": {org.pk: self.access.role}}
        return Response(s.OrganizationSerializer(org, context=ctx).data)


class OrganizationBillingProfileApi(OrgScopedView):
    """The billing profile: members who see billing read it; owners set who they are, the
    platform's finance team (any organization) also currency and tax rate."""

    permission_for = {"GET": "billing.read", "PATCH": "billing.read"}  # PATCH: the service

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        if billing_profile.may_set_billing_terms(request.user):
            APIView.initial(self, request, *args, **kwargs)
            org = get_object_or_404(Organization, public_id=kwargs["org_id"])
            self.access = OrgAccess(org, Role.OWNER)
            return
        super().initial(request, *args, **kwargs)

    def _answer(self, org: Organization) -> Response:
        editable = billing_profile.billing_profile_editable(organization=org,
                                                            acting_user=self.request.user)
        return Response(s.BillingProfileSerializer(org, context={"editable": editable}).data)

    @extend_schema(responses=s.BillingProfileSerializer)
    def get(self, request: Request, org_id: str) -> Response:
        return self._answer(self.org)

    @extend_schema(request=s.BillingProfileUpdateSerializer, responses=s.BillingProfileSerializer)
    def patch(self, request: Request, org_id: str) -> Response:
        body = s.BillingProfileUpdateSerializer(data=request.data, partial=True)
        body.is_valid(raise_exception=True)
        org = billing_profile.organization_billing_profile_update(
            organization=self.org, acting_user=request.user, **body.validated_data)
        return self._answer(org)


class ProjectListApi(OrgScopedView):
    permission_for = {"GET": "read", "POST": "projects.write"}

    @extend_schema(responses=s.ProjectSerializer(many=True))
    def get(self, request: Request, org_id: str) -> Response:
        projects = self.org.projects.order_by("created_at")
        return Response({"object": "list", "data": s.ProjectSerializer(projects, many=True).data})

    @extend_schema(request=s.ProjectSerializer, responses={201: s.ProjectSerializer})
    def post(self, request: Request, org_id: str) -> Response:
        body = s.ProjectSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        project = services.project_create(organization=self.org, name=body.validated_data["name"])
        return Response(s.ProjectSerializer(project).data, status=status.HTTP_201_CREATED)


class ProjectDetailApi(OrgScopedView):
    permission_for = {"GET": "read", "PATCH": "projects.write", "DELETE": "projects.write"}

    @extend_schema(responses=s.ProjectSerializer)
    def get(self, request: Request, org_id: str, project_id: str) -> Response:
        return Response(s.ProjectSerializer(self.project(project_id)).data)

    @extend_schema(request=s.ProjectSerializer, responses=s.ProjectSerializer)
    def patch(self, request: Request, org_id: str, project_id: str) -> Response:
        body = s.ProjectSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        project = services.project_update(
            project=self.project(project_id), name=body.validated_data["name"]
        )
        return Response(s.ProjectSerializer(project).data)

    @extend_schema(responses={200: s.ProjectSerializer},
                   description="Archive; revokes its keys.")
    def delete(self, request: Request, org_id: str, project_id: str) -> Response:
        project = services.project_archive(project=self.project(project_id),
                                           acting_user=request.user)
        return Response(s.ProjectSerializer(project).data)


class ApiKeyListApi(OrgScopedView):
    permission_for = {"GET": "read", "POST": "keys.write"}

    @extend_schema(responses=s.ApiKeySerializer(many=True))
    def get(self, request: Request, org_id: str, project_id: str) -> Response:
        project = self.project(project_id)
        keys = api_keys_for_project(project_id=project.pk).select_related("project")
        return Response({"object": "list", "data": s.ApiKeySerializer(keys, many=True).data})

    @extend_schema(request=s.ApiKeyCreateSerializer, responses={201: s.ApiKeyCreatedSerializer})
    def post(self, request: Request, org_id: str, project_id: str) -> Response:
        body = s.ApiKeyCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        key, secret = services.api_key_create(
            project=self.project(project_id), acting_user=request.user, **body.validated_data
        )
        data = s.ApiKeySerializer(key).data
        data["secret"] = secret
        return Response(data, status=status.HTTP_201_CREATED)


class ApiKeyDetailApi(OrgScopedView):
    permission_for = {"GET": "read", "POST": "keys.write", "DELETE": "keys.write"}

    def key(self, project_id: str, key_id: str) -> ApiKey:
        return get_object_or_404(
            ApiKey.objects.select_related("project"), organization=self.org,
            project__public_id=project_id, public_id=key_id,
        )

    @extend_schema(responses=s.ApiKeySerializer)
    def get(self, request: Request, org_id: str, project_id: str, key_id: str) -> Response:
        return Response(s.ApiKeySerializer(self.key(project_id, key_id)).data)

    @extend_schema(request=None, responses={200: s.ApiKeySerializer},
                   description="Revoke the key.")
    def delete(self, request: Request, org_id: str, project_id: str, key_id: str) -> Response:
        key = services.api_key_revoke(api_key=self.key(project_id, key_id),
                                      acting_user=request.user)
        return Response(s.ApiKeySerializer(key).data)


class ApiKeyRevokeApi(ApiKeyDetailApi):
    permission_for = {"POST": "keys.write"}

    @extend_schema(request=None, responses=s.ApiKeySerializer)
    def post(self, request: Request, org_id: str, project_id: str, key_id: str) -> Response:
        return self.delete(request, org_id, project_id, key_id)


class MemberListApi(OrgScopedView):
    permission_for = {"GET": "read", "POST": "members.write"}

    @extend_schema(responses=s.MemberSerializer(many=True))
    def get(self, request: Request, org_id: str) -> Response:
        members = self.org.memberships.select_related("user").order_by("created_at")
        return Response({"object": "list", "data": s.MemberSerializer(members, many=True).data})

    @extend_schema(request=s.InviteSerializer, responses={201: s.InvitationSerializer})
    def post(self, request: Request, org_id: str) -> Response:
        body = s.InviteSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        if hasattr(request.user, "principal"):
            raise exceptions.PermissionDenied("Invitations are sent by a person, not a key.")
        invitation, _token = services.member_invite(
            organization=self.org, acting_user=cast(User, request.user), **body.validated_data,
        )
        return Response(s.InvitationSerializer(invitation).data, status=status.HTTP_201_CREATED)


class MemberDetailApi(OrgScopedView):
    permission_for = {"GET": "read", "PATCH": "members.write", "DELETE": "members.write"}

    def member(self, member_id: int) -> Membership:
        return get_object_or_404(
            Membership.objects.select_related("user", "organization"),
            organization=self.org, pk=member_id,
        )

    @extend_schema(responses=s.MemberSerializer)
    def get(self, request: Request, org_id: str, member_id: int) -> Response:
        return Response(s.MemberSerializer(self.member(member_id)).data)

    @extend_schema(request=s.RoleSerializer, responses=s.MemberSerializer)
    def patch(self, request: Request, org_id: str, member_id: int) -> Response:
        body = s.RoleSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        membership = services.member_set_role(
            membership=self.member(member_id), role=body.validated_data["role"],
            acting_user=request.user,
        )
        return Response(s.MemberSerializer(membership).data)

    @extend_schema(request=None, responses={204: None})
    def delete(self, request: Request, org_id: str, member_id: int) -> Response:
        services.member_remove(membership=self.member(member_id), acting_user=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)
