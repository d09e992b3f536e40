"""Routes of the finance workspace's pages, ``/finance/`` (``finance_views``: reports;
``finance_operations``: invoices, closing periods, an organization's credits and items)."""

from django.urls import path

from billing_platform.console import finance_operations as ops
from billing_platform.console import finance_views as views

app_name = "finance"

urlpatterns = [
    path("", views.home, name="home"),
    path("reports/<str:name>/", views.report, name="report"),
    path("invoices/", ops.invoices, name="invoices"),
    path("invoices/<str:public_id>/", ops.invoice, name="invoice"),
    path("invoices/<str:public_id>/<str:operation>/", ops.invoice_operation,
         name="invoice-operation"),
    path("close/", ops.close, name="close"),
    path("organizations/<str:public_id>/", ops.organization, name="organization"),
    path("organizations/<str:public_id>/<str:operation>/", ops.organization_operation,
         name="organization-operation"),
]
