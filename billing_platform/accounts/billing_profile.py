"""An organization's billing profile: who its invoices are addressed to, and how it is billed.

Two kinds of people set it. The organization's owners set who they are: the legal name, the
address, the tax id and the billing email (an admin or developer cannot: these are what the
invoices, and the tax authority, see). The platform's finance team (``finance.operate``, or
staff) sets those and how the organization is billed: its currency and tax rate, which no
customer may set for themselves. An API key is never either (a key's role is capped at admin).

The permission is checked by name (``user.has_perm("finance.operate")``): the finance app's
helpers may not be imported here (nothing imports finance, tests/test_architecture.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any

from django.apps import apps
from django.core.exceptions import ValidationError
from django.core.validators import validate_email
from django.db import models, transaction

from billing_platform.accounts.choices import Role
from billing_platform.accounts.models import ApiKey, Organization
from billing_platform.accounts.selectors import authority_of
from billing_platform.accounts.services import organization_saved, organization_state
from billing_platform.errors import Forbidden, InvalidRequest

OWNER_FIELDS = ("legal_name", "address_line1", "address_line2", "postal_code", "city",
                "region", "country", "tax_id", "billing_email")
FINANCE_FIELDS = ("currency", "tax_rate")
PROFILE_FIELDS = OWNER_FIELDS + FINANCE_FIELDS
FINANCE_OPERATE = "finance.operate"  # billing_platform.finance.permissions.OPERATE

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_PATTERNS = {
    "country": (re.compile(r"[A-Z]{2}"), "an ISO 3166-1 alpha-2 country code, e.g. DE"),
    "postal_code": (re.compile(r"[A-Z0-9](?:[A-Z0-9 -]*[A-Z0-9])?"),
                    "letters, digits, spaces and hyphens"),
    "tax_id": (re.compile(r"[A-Z0-9](?:[A-Z0-9 ./-]*[A-Z0-9])?"),
               "letters, digits, spaces and . / -"),
}
_UPPER = frozenset({"country", "postal_code", "tax_id"})


def max_length(name: str) -> int:
    """Return the most characters the profile's text field ``name`` holds."""
    field = Organization._meta.get_field(name)
    if not isinstance(field, models.CharField) or field.max_length is None:
        raise TypeError(f"Organization.{name} is not a text field with a length")
    return field.max_length


def may_set_billing_terms(user: Any) -> bool:
    """Return whether ``user`` may set an organization's currency and tax rate (finance)."""
    if user is None:
        return True  # the system itself (a migration, a management command)
    if isinstance(user, ApiKey) or hasattr(user, "principal"):
        return False
    if not (getattr(user, "is_authenticated", False) and getattr(user, "is_active", False)):
        return False
    return bool(user.is_staff or user.has_perm(FINANCE_OPERATE))


def billing_profile_editable(*, organization: Organization, acting_user: Any
                             ) -> tuple[str, ...]:
    """Return the billing profile fields ``acting_user`` may change in ``organization``."""
    if may_set_billing_terms(acting_user):
        return PROFILE_FIELDS
    authority = authority_of(organization_id=organization.pk, acting_user=acting_user)
    return OWNER_FIELDS if authority.role == Role.OWNER else ()


def _text(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise InvalidRequest(f"{name} must be a string.", param=name)
    text = value.strip()
    if _CONTROL.search(text):
        raise InvalidRequest(f"{name} must be one line of text, without control characters.",
                             param=name)
    limit = max_length(name)
    if len(text) > limit:
        raise InvalidRequest(f"{name} is at most {limit} characters.", param=name)
    if name in _UPPER:
        text = text.upper()
    pattern = _PATTERNS.get(name)
    if text and pattern is not None and not pattern[0].fullmatch(text):
        raise InvalidRequest(f"{name} must be {pattern[1]}.", param=name)
    return text


def _email(name: str, value: object) -> str:
    text = _text(name, value)
    try:
        validate_email(text)
    except ValidationError as exc:
        raise InvalidRequest("billing_email must be a valid email address.", param=name) from exc
    return text


def _currency(name: str, value: object) -> str:
    code = _text(name, value).upper()
    if not re.fullmatch(r"[A-Z]{3}", code):
        raise InvalidRequest("currency must be an ISO 4217 code, e.g. EUR.", param=name)
    # usage in a currency without a default price book could not be rated (plans.rating);
    # the registry, not an import, so accounts does not depend on plans at load time
    books = apps.get_model("plans", "PriceBook").objects
    if not books.filter(currency=code, is_default=True).exists():
        raise InvalidRequest(f"There is no default price book in {code}: usage in it could "
                             "not be priced. Create one first.", param=name)
    return code


def _tax_rate(name: str, value: object) -> Decimal:
    try:
        rate = value if isinstance(value, Decimal) else Decimal(str(value).strip())
    except InvalidOperation as exc:
        raise InvalidRequest("tax_rate must be a decimal fraction, e.g. 0.19.", param=name
                             ) from exc
    if isinstance(value, bool | float) or not rate.is_finite() or not Decimal(0) <= rate < 1:
        raise InvalidRequest("tax_rate is a fraction from 0 up to (not including) 1, e.g. 0.19 "
                             "for 19 %.", param=name)
    if rate != rate.quantize(Decimal("0.0001")):
        raise InvalidRequest("tax_rate has at most 4 decimal places.", param=name)
    return rate


_CLEAN: dict[str, Callable[[str, object], object]] = {
    **dict.fromkeys(OWNER_FIELDS, _text), "billing_email": _email, "currency": _currency,
    "tax_rate": _tax_rate}


@transaction.atomic
def organization_billing_profile_update(*, organization: Organization, acting_user: Any,
                                        **fields: object) -> Organization:
    """Change an organization's billing profile, within what ``acting_user`` may set.

    Raises ``InvalidRequest`` for a field outside the profile or a malformed value, and
    ``Forbidden`` for a field the actor may not set; then nothing is changed. The change and
    its audit row (``organization.update``, the fields before and after) commit together.
    """
    unknown = next((name for name in fields if name not in PROFILE_FIELDS), None)
    if unknown is not None:
        raise InvalidRequest(f"{unknown} is not part of the billing profile.", param=unknown)
    editable = billing_profile_editable(organization=organization, acting_user=acting_user)
    if not editable:
        raise Forbidden("Only the organization's owners and the platform's finance team may "
                        "change its billing profile.")
    denied = next((name for name in fields if name not in editable), None)
    if denied is not None:
        raise Forbidden(f"{denied} is set by the platform's finance team.", param=denied)
    cleaned = {name: _CLEAN[name](name, value) for name, value in fields.items()}
    locked = Organization.objects.select_for_update().get(pk=organization.pk)
    before = organization_state(locked)
    for name, value in cleaned.items():
        setattr(locked, name, value)
        setattr(organization, name, value)
    if cleaned:
        locked.save(update_fields=list(cleaned))
    organization_saved(organization=locked, before=before, acting_user=acting_user)
    return locked
