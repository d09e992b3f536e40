"""Invoicing routes: /api/v1/ invoices, plan advice and the Stripe webhook (/stripe/webhook/)."""

from django.urls import path, re_path

from billing_platform.invoicing import advice_apis, apis

ORG = "api/v1/organizations/<str:org_id>/invoices"

urlpatterns = [
    re_path(r"^api/v1/invoices/upcoming/?$", apis.UpcomingInvoiceApi.as_view(),
            name="invoice-upcoming-self"),
    path(f"{ORG}/", apis.InvoiceListApi.as_view(), name="invoice-list"),
    path(f"{ORG}/upcoming/", apis.UpcomingInvoiceApi.as_view(), name="invoice-upcoming"),
    path(f"{ORG}/<str:invoice_id>/", apis.InvoiceDetailApi.as_view(), name="invoice-detail"),
    path(f"{ORG}/<str:invoice_id>/pdf/", apis.InvoicePdfApi.as_view(), name="invoice-pdf"),
    path(f"{ORG}/<str:invoice_id>/csv/", apis.InvoiceCsvApi.as_view(), name="invoice-csv"),
    re_path(r"^api/v1/organizations/(?P<org_id>[^/]+)/plan_advice/?$",
            advice_apis.PlanAdviceApi.as_view(), name="plan-advice"),
    path("stripe/webhook/", apis.stripe_webhook, name="stripe-webhook"),
]
