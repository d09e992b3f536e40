"""Usage API routes (mounted under /api/v1/)."""

from django.urls import path

from metering import apis, staff_apis

urlpatterns = [
    path("usage/events", apis.UsageEventIngestApi.as_view(), name="usage-events"),
    path("usage/dead_letters/", staff_apis.DeadLetterListApi.as_view(),
         name="usage-dead-letters"),
    path("usage/dead_letters/retry", staff_apis.DeadLetterBulkRetryApi.as_view(),
         name="usage-dead-letters-retry"),
    path("usage/dead_letters/<int:letter_id>/retry", staff_apis.DeadLetterRetryApi.as_view(),
         name="usage-dead-letter-retry"),
    path("usage", apis.UsageApi.as_view(), name="usage"),
]
