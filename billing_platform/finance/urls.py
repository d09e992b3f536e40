"""Routes of ``/api/v1/finance/`` (included before the other ``api/v1/`` includes): the
reports (``apis``) and finance's operations (``operations_apis``)."""

from django.urls import URLPattern, URLResolver, path, re_path

from billing_platform.finance import apis
from billing_platform.finance import operations_apis as ops
from billing_platform.finance.advice_apis import FinancePlanAdviceApi
from billing_platform.finance.margin_apis import MarginReportApi

INVOICE = "finance/invoices/<str:invoice_id>"
ORG = "finance/organizations/<str:org_id>"

urlpatterns: list[URLPattern | URLResolver] = [
    path("finance/revenue/", apis.RevenueReportApi.as_view(), name="finance-revenue"),
    path("finance/receivables/", apis.ReceivablesReportApi.as_view(),
         name="finance-receivables"),
    path("finance/credits/", apis.CreditsReportApi.as_view(), name="finance-credits"),
    path("finance/customers/", apis.CustomersReportApi.as_view(), name="finance-customers"),
    path("finance/margin/", MarginReportApi.as_view(), name="finance-margin"),
    # operations (POST, finance.operate, Idempotency-Key)
    path("finance/periods/close/", ops.PeriodCloseApi.as_view(), name="finance-period-close"),
    path(f"{INVOICE}/void/", ops.InvoiceVoidApi.as_view(), name="finance-invoice-void"),
    path(f"{INVOICE}/credit-notes/", ops.CreditNoteCreateApi.as_view(),
         name="finance-credit-note-create"),
    path(f"{INVOICE}/mark-paid/", ops.InvoiceMarkPaidApi.as_view(),
         name="finance-invoice-mark-paid"),
    path(f"{INVOICE}/retry-charge/", ops.InvoiceRetryChargeApi.as_view(),
         name="finance-invoice-retry-charge"),
    path(f"{INVOICE}/dunning/pause/", ops.InvoiceDunningPauseApi.as_view(),
         name="finance-invoice-dunning-pause"),
    path(f"{INVOICE}/dunning/resume/", ops.InvoiceDunningResumeApi.as_view(),
         name="finance-invoice-dunning-resume"),
    path(f"{INVOICE}/write-off/", ops.InvoiceWriteOffApi.as_view(),
         name="finance-invoice-write-off"),
    path(f"{ORG}/credit-grants/", ops.CreditGrantCreateApi.as_view(),
         name="finance-credit-grant-create"),
    path(f"{ORG}/invoice-items/", ops.InvoiceItemCreateApi.as_view(),
         name="finance-invoice-item-create"),
    # an organization's plan advice (issue 18 item 4), with or without the trailing slash
    re_path(r"^finance/organizations/(?P<org_id>[^/]+)/plan_advice/?$",
            FinancePlanAdviceApi.as_view(), name="finance-plan-advice"),
]
