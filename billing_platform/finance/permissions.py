"""Who may use the finance workspace: the platform's finance team, by permission.

``finance.view_reports`` (group "Finance analyst") reads reports across organizations;
``finance.operate`` (group "Finance controller", which also reads) runs operations. Anyone
else, signed in or not, gets 404 on ``/finance/`` and ``/api/v1/finance/``: the workspace does
not confirm it exists to a customer. An API key is never a finance user (keys belong to one
organization's project). Django's ``has_perm`` is true for a superuser; that is accepted.
"""

from __future__ import annotations

from typing import Any

from rest_framework import exceptions, permissions
from rest_framework.request import Request

VIEW_REPORTS = "finance.view_reports"
OPERATE = "finance.operate"
ANALYST_GROUP = "Finance analyst"
CONTROLLER_GROUP = "Finance controller"
# Each group's permissions (codenames of app ``finance``); migration 0001 created them.
GROUP_PERMISSIONS = {ANALYST_GROUP: ("view_reports",),
                     CONTROLLER_GROUP: ("view_reports", "operate")}


def _has(user: Any, perm: str) -> bool:
    if user is None or not getattr(user, "is_authenticated", False):
        return False
    if hasattr(user, "principal"):  # an API key (accounts.authentication.KeyUser)
        return False
    if not getattr(user, "is_active", False):
        return False
    return bool(user.has_perm(perm))


def can_read_finance(user: Any) -> bool:
    """Return whether ``user`` may read the finance reports of every organization."""
    return _has(user, VIEW_REPORTS)


def can_operate_finance(user: Any) -> bool:
    """Return whether ``user`` may run finance operations."""
    return _has(user, OPERATE)


class FinanceReader(permissions.BasePermission):
    """DRF permission: ``finance.view_reports``, else 404 (never 401/403)."""

    def has_permission(self, request: Request, view: Any) -> bool:
        if not can_read_finance(request.user):
            raise exceptions.NotFound()
        return True


class FinanceOperator(permissions.BasePermission):
    """DRF permission: ``finance.operate``, else 404 (never 401/403)."""

    def has_permission(self, request: Request, view: Any) -> bool:
        if not can_operate_finance(request.user):
            raise exceptions.NotFound()
        return True
