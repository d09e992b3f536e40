"""Template context: the console's current organization, the org switcher's choices, and
whether the user reads the platform's finance workspace (its link in the header)."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest

from billing_platform.accounts.selectors import organizations_for_user
from billing_platform.finance.permissions import can_read_finance


def current_org(request: HttpRequest) -> dict[str, Any]:
    access = getattr(request, "org_access", None)
    user = getattr(request, "user", None)
    orgs = organizations_for_user(user=user) if access and user else []
    return {"access": access, "org": access.organization if access else None,
            "switchable_orgs": orgs, "can_read_finance": can_read_finance(user)}
