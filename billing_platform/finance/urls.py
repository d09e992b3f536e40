"""Routes of ``/api/v1/finance/`` (included before the other ``api/v1/`` includes): the
reports (``apis``) and finance's operations (``operations_apis``)."""

from django.urls import URLPattern, URLResolver, path

from billing_platform.finance import apis

urlpatterns: list[URLPattern | URLResolver] = [
    path("finance/revenue/", apis.RevenueReportApi.as_view(), name="finance-revenue"),
    path("finance/receivables/", apis.ReceivablesReportApi.as_view(),
         name="finance-receivables"),
    path("finance/credits/", apis.CreditsReportApi.as_view(), name="finance-credits"),
    path("finance/customers/", apis.CustomersReportApi.as_view(), name="finance-customers"),
]
