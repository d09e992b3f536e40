"""The base of every /api/v1 view that works inside one organization.

Every object is looked up inside the caller's organization, so another organization's object
is a 404, never a 403 that would confirm it exists. Role rules come from ``ROLE_PERMISSIONS``
(``accounts.selectors.org_access``); a view declares which permission each method needs.
"""

from __future__ import annotations

from typing import Any, ClassVar

from django.shortcuts import get_object_or_404
from rest_framework import exceptions
from rest_framework.request import Request
from rest_framework.views import APIView

from billing_platform.accounts.models import Organization, Project
from billing_platform.accounts.selectors import OrgAccess, org_access


class OrgScopedView(APIView):
    """Resolve ``org_id`` to the caller's access; check the permission for the HTTP method."""

    permission_for: ClassVar[dict[str, str]] = {"GET": "read"}
    access: OrgAccess

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)
        self.access = org_access(
            user=request.user, principal=getattr(request.user, "principal", None),
            org_public_id=kwargs["org_id"],
        )
        needed = self.permission_for.get(request.method or "GET", "read")
        if not self.access.can(needed):
            raise exceptions.PermissionDenied(
                f"Your role ({self.access.role}) does not allow this ({needed})."
            )

    @property
    def org(self) -> Organization:
        return self.access.organization

    def project(self, project_id: str) -> Project:
        return get_object_or_404(Project, organization=self.org, public_id=project_id)
