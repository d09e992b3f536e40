"""Read-only admin views of usage: events are financial records, never edited by hand."""

from __future__ import annotations

from django.contrib import admin

from metering.models import UsageDeadLetter, UsageEvent, UsageIdConflict, UsageRollupHourly


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


@admin.register(UsageEvent)
class UsageEventAdmin(ReadOnlyAdmin):
    list_display = ["request_id", "organization_id", "model", "service_tier", "status",
                    "prompt_tokens", "completion_tokens", "amount", "currency", "event_time"]
    list_filter = ["status", "service_tier", "capacity_source"]
    search_fields = ["=request_id"]
    date_hierarchy = "event_time"
    show_full_result_count = False


@admin.register(UsageRollupHourly)
class UsageRollupHourlyAdmin(ReadOnlyAdmin):
    list_display = ["hour", "organization_id", "project_id", "model", "service_tier",
                    "requests", "prompt_tokens", "completion_tokens", "amount", "currency"]
    list_filter = ["service_tier", "capacity_source"]


@admin.register(UsageDeadLetter)
class UsageDeadLetterAdmin(ReadOnlyAdmin):
    list_display = ["id", "origin", "error", "created_at", "resolved_at"]
    list_filter = ["origin"]


@admin.register(UsageIdConflict)
class UsageIdConflictAdmin(ReadOnlyAdmin):
    list_display = ["request_id", "organization_id", "source", "reported_by", "attempts",
                    "first_seen_at", "last_seen_at"]
    list_filter = ["source"]
    search_fields = ["=request_id", "=reported_by"]
