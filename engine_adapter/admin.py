"""Admin views of the fleet for staff."""

from django.contrib import admin

from engine_adapter.models import EngineInstance, Pool


@admin.register(Pool)
class PoolAdmin(admin.ModelAdmin):
    list_display = ["name", "model", "region", "zone", "launch", "replicas", "gpu_hourly_cost",
                    "in_spec"]


@admin.register(EngineInstance)
class EngineInstanceAdmin(admin.ModelAdmin):
    list_display = ["engine_id", "status", "url", "pid", "restarts", "last_seen_at"]
    list_filter = ["status"]
