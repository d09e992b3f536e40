"""Staff read the audit log in Django admin; nobody adds, edits or deletes a row there.
``AuditedModelAdmin`` is the base of every admin that edits prices, plans or what customers hold.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from billing_platform.audit.models import AuditEvent
from billing_platform.audit.services import (
    audit_plain,
    audit_record,
    audit_snapshot,
    is_secret_field,
)


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    list_display = ("created_at", "actor_label", "action", "target", "organization_id",
                    "request_id")
    list_filter = ("action",)
    search_fields = ("action", "target", "actor_label", "request_id")
    date_hierarchy = "created_at"

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


def _target(obj: Any) -> str:
    return str(getattr(obj, "public_id", None) or getattr(obj, "code", None) or obj.pk)


def _action(obj: Any, verb: str) -> str:
    return f"admin.{obj._meta.model_name}.{verb}"


def audit_admin_delete(request: HttpRequest, objs: list[Any]) -> None:
    """Write one audit row per object a staff member deletes in the admin."""
    for obj in objs:
        audit_record(acting_user=request.user,
                     organization=getattr(obj, "organization_id", None),
                     action=_action(obj, "delete"), target=_target(obj),
                     before=audit_snapshot(obj))


class AuditedModelAdmin(admin.ModelAdmin):
    """A ModelAdmin whose saves and deletes write audit rows (admin views run in a transaction,
    so the row commits with the change). Changed fields go in before/after; inline rows too."""

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        super().save_model(request, obj, form, change)
        changed = [f for f in form.changed_data if not is_secret_field(f)]
        audit_record(
            acting_user=request.user, organization=getattr(obj, "organization_id", None),
            action=_action(obj, "change" if change else "add"), target=_target(obj),
            before={f: audit_plain(form.initial.get(f)) for f in changed} if change else None,
            after={f: audit_plain(form.cleaned_data.get(f)) for f in changed})

    def delete_model(self, request: HttpRequest, obj: Any) -> None:
        audit_admin_delete(request, [obj])
        super().delete_model(request, obj)

    def delete_queryset(self, request: HttpRequest, queryset: Any) -> None:
        audit_admin_delete(request, list(queryset))
        super().delete_queryset(request, queryset)

    def save_formset(self, request: HttpRequest, form: Any, formset: Any, change: bool) -> None:
        super().save_formset(request, form, formset, change)
        parent = form.instance
        rows = ([("add", o) for o in formset.new_objects]
                + [("change", o) for o, _ in formset.changed_objects]
                + [("delete", o) for o in formset.deleted_objects])
        for verb, obj in rows:
            audit_record(acting_user=request.user,
                         organization=getattr(parent, "organization_id", None),
                         action=_action(obj, verb), target=_target(parent),
                         after=None if verb == "delete" else audit_snapshot(obj))

