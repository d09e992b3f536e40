"""Django admin for staff: organizations, members, projects and keys (secrets never shown).

The admin saves rows itself, so each save or delete that changes what a key may do calls the
service that makes it take effect at once (the key cache is held before the commit and
released after, as the services do) and writes the audit row. If the key cache cannot be
reached the save is rolled back and the page says so: a revoked key is never left usable.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.contrib.auth.admin import UserAdmin as BaseUserAdmin
from django.db import transaction
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect

from billing_platform.accounts import services
from billing_platform.accounts.models import (
    ApiKey,
    Invitation,
    Membership,
    Organization,
    Project,
    User,
)
from billing_platform.audit.admin import AuditedModelAdmin, audit_admin_delete


class KeyCacheAwareAdmin(admin.ModelAdmin):
    """Show a failed key-cache hold as an error on the page (the save was rolled back)."""

    def changeform_view(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        try:
            return super().changeform_view(request, *args, **kwargs)
        except services.KeyCacheUnavailable as exc:
            self.message_user(request, exc.message, messages.ERROR)
            return HttpResponseRedirect(request.get_full_path())

    def delete_view(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        try:
            return super().delete_view(request, *args, **kwargs)
        except services.KeyCacheUnavailable as exc:
            self.message_user(request, exc.message, messages.ERROR)
            return HttpResponseRedirect(request.get_full_path())

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        try:
            return super().changelist_view(request, extra_context)
        except services.KeyCacheUnavailable as exc:
            self.message_user(request, exc.message, messages.ERROR)
            return HttpResponseRedirect(request.get_full_path())


def _refresh_keys(keys: QuerySet[ApiKey]) -> None:
    services.api_key_cache_refresh(prefixes=list(keys.values_list("prefix", flat=True)))


@admin.register(User)
class UserAdmin(KeyCacheAwareAdmin, AuditedModelAdmin, BaseUserAdmin):
    """Users; a change of who is staff, superuser or active is an audit row like any other."""

    ordering = ["email"]
    list_display = ["email", "is_staff", "is_active", "date_joined"]
    search_fields = ["email"]
    fieldsets = [
        (None, {"fields": ["email", "password"]}),
        ("Permissions", {"fields": ["is_active", "is_staff", "is_superuser", "groups"]}),
    ]
    add_fieldsets = [(None, {"classes": ["wide"],
                             "fields": ["email", "password1", "password2"]})]

    def _revoke_keys_of(self, request: HttpRequest, users: QuerySet[User], reason: str) -> None:
        # A deleted user's keys would be left without a maker (created_by NULL), which reads
        # as a key the platform made; a deactivated one has no authority left to lend them.
        services.api_keys_revoke(keys=ApiKey.objects.filter(created_by__in=users,
                                                            revoked_at__isnull=True),
                                 acting_user=request.user, reason=reason)

    def save_model(self, request: HttpRequest, obj: User, form: Any, change: bool) -> None:
        super().save_model(request, obj, form, change)
        if change and "is_active" in form.changed_data and not obj.is_active:
            self._revoke_keys_of(request, User.objects.filter(pk=obj.pk), "user deactivated")

    def delete_model(self, request: HttpRequest, obj: User) -> None:
        with transaction.atomic():
            self._revoke_keys_of(request, User.objects.filter(pk=obj.pk), "user deleted")
            super().delete_model(request, obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[User]) -> None:
        with transaction.atomic():
            self._revoke_keys_of(request, queryset, "user deleted")
            super().delete_queryset(request, queryset)


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    raw_id_fields = ["user"]


@admin.register(Organization)
class OrganizationAdmin(KeyCacheAwareAdmin):
    list_display = ["name", "public_id", "data_zone", "currency", "status", "created_at"]
    list_filter = ["status", "data_zone"]
    search_fields = ["name", "slug", "public_id", "billing_email"]
    inlines = [MembershipInline]

    def save_model(self, request: HttpRequest, obj: Organization, form: Any,
                   change: bool) -> None:
        before = (services.organization_state(Organization.objects.get(pk=obj.pk)) if change
                  else None)
        super().save_model(request, obj, form, change)
        services.organization_saved(organization=obj, before=before, acting_user=request.user)

    def save_formset(self, request: HttpRequest, form: Any, formset: Any, change: bool) -> None:
        if formset.model is not Membership:
            super().save_formset(request, form, formset, change)
            return
        old_roles = dict(Membership.objects.filter(organization=form.instance)
                         .values_list("user_id", "role"))
        super().save_formset(request, form, formset, change)
        # what the services do: an audit row per member added, re-roled or removed, and the
        # keys that a removed member or a new role could not make revoked (rows are matched
        # by user: a deleted row has lost its pk by now)
        changes = ([(m, None, m.role) for m in formset.new_objects]
                   + [(m, old_roles.get(m.user_id), m.role) for m, _ in formset.changed_objects]
                   + [(m, old_roles.get(m.user_id), None) for m in formset.deleted_objects])
        for membership, before, role in changes:
            services.member_saved(user=membership.user, organization=form.instance,
                                  before=before, role=role, acting_user=request.user)

    def delete_model(self, request: HttpRequest, obj: Organization) -> None:
        with transaction.atomic():
            _refresh_keys(ApiKey.objects.filter(organization=obj))
            super().delete_model(request, obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Organization]) -> None:
        with transaction.atomic():
            _refresh_keys(ApiKey.objects.filter(organization__in=queryset))
            super().delete_queryset(request, queryset)


@admin.register(Project)
class ProjectAdmin(KeyCacheAwareAdmin):
    list_display = ["name", "public_id", "organization", "status"]
    search_fields = ["name", "public_id"]

    def save_model(self, request: HttpRequest, obj: Project, form: Any, change: bool) -> None:
        super().save_model(request, obj, form, change)
        if change and "status" in form.changed_data and obj.status == "archived":
            services.project_archive(project=obj, acting_user=request.user)

    def delete_model(self, request: HttpRequest, obj: Project) -> None:
        with transaction.atomic():
            _refresh_keys(ApiKey.objects.filter(project=obj))
            super().delete_model(request, obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Project]) -> None:
        with transaction.atomic():
            _refresh_keys(ApiKey.objects.filter(project__in=queryset))
            super().delete_queryset(request, queryset)


@admin.register(ApiKey)
class ApiKeyAdmin(KeyCacheAwareAdmin):
    list_display = ["name", "redacted", "organization", "project", "revoked_at", "last_used_at"]
    search_fields = ["name", "prefix", "public_id"]
    exclude = ["secret_hash"]
    readonly_fields = ["prefix", "organization", "project", "created_by", "last_used_at"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # a key is made through the API or console, which show its secret once

    def save_model(self, request: HttpRequest, obj: ApiKey, form: Any, change: bool) -> None:
        before = (services.api_key_state(ApiKey.objects.select_related("project").get(pk=obj.pk))
                  if change else None)
        super().save_model(request, obj, form, change)
        services.api_key_saved(api_key=obj, before=before, acting_user=request.user)

    def delete_model(self, request: HttpRequest, obj: ApiKey) -> None:
        with transaction.atomic():
            _refresh_keys(ApiKey.objects.filter(pk=obj.pk))
            audit_admin_delete(request, [obj])
            super().delete_model(request, obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        with transaction.atomic():
            _refresh_keys(queryset)
            audit_admin_delete(request, list(queryset))
            super().delete_queryset(request, queryset)


@admin.register(Invitation)
class InvitationAdmin(admin.ModelAdmin):
    list_display = ["email", "organization", "role", "expires_at", "accepted_at"]
    exclude = ["token_hash"]
