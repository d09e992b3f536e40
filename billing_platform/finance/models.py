"""The finance workspace's permissions; the app owns no money tables of its own.

``FinanceAccess`` is a permission-only model (unmanaged, no table): it exists so that the two
platform-level permissions have a content type to hang on. ``finance.view_reports`` reads every
organization's reports; ``finance.operate`` also runs finance's corrections (close, void,
credit notes, write-offs, ...). The data migration puts them in the "Finance analyst" and
"Finance controller" groups. An organization's own ``finance`` members (accounts
``Role.FINANCE``) are a different thing: they see only their organization.
"""

from django.db import models


class FinanceAccess(models.Model):
    """Holds the finance workspace's permissions; never stored (no table)."""

    class Meta:
        managed = False
        default_permissions = ()
        permissions = [
            ("view_reports", "Read the finance reports of every organization"),
            ("operate", "Run finance operations (close, void, credit, write off, grant)"),
        ]

    def __str__(self) -> str:
        return "finance workspace access"
