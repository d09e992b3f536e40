"""Read-only admin views of usage: events are financial records, never edited by hand. Dead
letters have one action, a retry (the same service as the staff API's)."""

from __future__ import annotations

from collections import Counter

from django.contrib import admin, messages
from django.db.models import Model, QuerySet
from django.http import HttpRequest

from metering import services
from metering.models import UsageDeadLetter, UsageEvent, UsageIdConflict, UsageRollupHourly
from metering.recording import TRANSIENT
from metering.serializers import MAX_RETRY_IDS


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
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
    """Letters are kept as they came; the one thing staff do to them is retry them."""

    list_display = ["id", "origin", "error", "created_at", "resolved_at"]
    list_filter = [("resolved_at", admin.EmptyFieldListFilter), "origin"]
    actions = ["retry_selected"]

    @admin.action(description="Retry the selected dead letters (safe to repeat; audited)")
    def retry_selected(self, request: HttpRequest, queryset: QuerySet[UsageDeadLetter]) -> None:
        ids = list(queryset.order_by("id").values_list("pk", flat=True)[:MAX_RETRY_IDS + 1])
        if len(ids) > MAX_RETRY_IDS:
            self.message_user(request, f"Select at most {MAX_RETRY_IDS} letters at once.",
                              messages.ERROR)
            return
        try:
            results = services.usage_dead_letters_retry(letter_ids=ids,
                                                        acting_user=request.user)
        except TRANSIENT as exc:
            self.message_user(request, f"PostgreSQL refused the retry ({type(exc).__name__}); "
                                       "try again.", messages.ERROR)
            return
        counts = Counter(r.outcome for r in results)
        summary = ", ".join(f"{n} {outcome.replace('_', ' ')}" for outcome, n in
                            sorted(counts.items()))
        failed = [r for r in results if r.outcome == "failed"]
        self.message_user(request, f"Retried {len(results)}: {summary}."
                          + (f" Still failing, e.g. #{failed[0].letter_id}: {failed[0].error}"
                             if failed else ""),
                          messages.WARNING if failed else messages.SUCCESS)


@admin.register(UsageIdConflict)
class UsageIdConflictAdmin(ReadOnlyAdmin):
    list_display = ["request_id", "organization_id", "source", "reported_by", "attempts",
                    "first_seen_at", "last_seen_at"]
    list_filter = ["source"]
    search_fields = ["=request_id", "=reported_by"]
