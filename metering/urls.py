"""Usage API routes (mounted under /api/v1/)."""

from django.urls import path

from metering import apis

urlpatterns = [
    path("usage/events", apis.UsageEventIngestApi.as_view(), name="usage-events"),
    path("usage", apis.UsageApi.as_view(), name="usage"),
]
