"""Top-level URL map: /v1 gateway, /api/v1 management API, /console, /finance (the platform's
finance workspace), /admin, /metrics."""

from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from billing_platform.metrics import metrics_view

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="console:dashboard", permanent=False)),
    path("admin/", admin.site.urls),
    path("v1/", include("billing_platform.gateway.urls")),
    path("api/v1/", include("billing_platform.finance.urls")),
    path("api/v1/", include("billing_platform.accounts.urls")),
    path("api/v1/", include("metering.urls")),
    path("api/v1/", include("plans.urls")),
    path("api/v1/", include("billing_platform.audit.urls")),
    path("", include("billing_platform.invoicing.urls")),
    path("api/v1/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/v1/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("console/", include("billing_platform.console.urls")),
    path("finance/", include("billing_platform.console.finance_urls")),
    path("metrics", metrics_view, name="metrics"),
]

# A URL no route matches: DRF's error shape under /api/, Django's page elsewhere.
handler404 = "billing_platform.api.errors.not_found"
