"""Template context: the console's current organization and the org switcher's choices."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest

from billing_platform.accounts.selectors import organizations_for_user


def current_org(request: HttpRequest) -> dict[str, Any]:
    access = getattr(request, "org_access", None)
    user = getattr(request, "user", None)
    orgs = organizations_for_user(user=user) if access and user else []
    return {"access": access, "org": access.organization if access else None,
            "switchable_orgs": orgs}
