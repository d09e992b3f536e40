"""Django admin for staff: organizations, members, projects and keys (secrets never shown)."""

from django.contrib import admin
from django.contrib.auth.admin import UserAdmin as BaseUserAdmin

from billing_platform.accounts.models import (
    ApiKey,
    Invitation,
    Membership,
    Organization,
    Project,
    User,
)


@admin.register(User)
class UserAdmin(BaseUserAdmin):
    ordering = ["email"]
    list_display = ["email", "is_staff", "is_active", "date_joined"]
    search_fields = ["email"]
    fieldsets = [
        (None, {"fields": ["email", "password"]}),
        ("Permissions", {"fields": ["is_active", "is_staff", "is_superuser", "groups"]}),
    ]
    add_fieldsets = [(None, {"classes": ["wide"],
                             "fields": ["email", "password1", "password2"]})]


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    raw_id_fields = ["user"]


@admin.register(Organization)
class OrganizationAdmin(admin.ModelAdmin):
    list_display = ["name", "public_id", "data_zone", "currency", "status", "created_at"]
    list_filter = ["status", "data_zone"]
    search_fields = ["name", "slug", "public_id", "billing_email"]
    inlines = [MembershipInline]


@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin):
    list_display = ["name", "public_id", "organization", "status"]
    search_fields = ["name", "public_id"]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["name", "redacted", "organization", "project", "revoked_at", "last_used_at"]
    search_fields = ["name", "prefix", "public_id"]
    exclude = ["secret_hash"]
    readonly_fields = ["prefix", "organization", "project", "created_by", "last_used_at"]


@admin.register(Invitation)
class InvitationAdmin(admin.ModelAdmin):
    list_display = ["email", "organization", "role", "expires_at", "accepted_at"]
    exclude = ["token_hash"]
