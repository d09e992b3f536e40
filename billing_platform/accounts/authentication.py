"""DRF authentication by API key (``Authorization: Bearer tg-...``) for the management API."""

from __future__ import annotations

from dataclasses import dataclass

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions
from rest_framework.request import Request

from billing_platform.accounts.selectors import KeyPrincipal, api_key_authenticate


@dataclass(frozen=True)
class KeyUser:
    """The ``request.user`` of a key-authenticated request: no person, only the key."""

    principal: KeyPrincipal
    is_authenticated: bool = True
    is_anonymous: bool = False
    is_staff: bool = False

    def __str__(self) -> str:
        return f"api-key:{self.principal.key_public_id}"


class ApiKeyAuthentication(authentication.BaseAuthentication):
    """Authenticate ``Bearer tg-...``; anything else falls through to session auth."""

    keyword = "Bearer"

    def authenticate(self, request: Request) -> tuple[KeyUser, KeyPrincipal] | None:
        header = authentication.get_authorization_header(request).decode(errors="replace")
        if not header.startswith(f"{self.keyword} "):
            return None
        principal = api_key_authenticate(header[len(self.keyword) + 1:])
        if principal is None:
            raise exceptions.AuthenticationFailed("Invalid, revoked or expired API key.")
        return KeyUser(principal), principal

    def authenticate_header(self, request: Request) -> str:
        return f'{self.keyword} realm="tollgate"'


class ApiKeyScheme(OpenApiAuthenticationExtension):
    """Describe API-key auth in the OpenAPI schema as an HTTP bearer scheme."""

    target_class = "billing_platform.accounts.authentication.ApiKeyAuthentication"
    name = "ApiKey"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "bearerFormat": "tg-<prefix>_<secret>",
                "description": "A Tollgate API key with the scope the endpoint needs."}
