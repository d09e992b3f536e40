"""Console routes."""

from django.contrib.auth import views as auth_views
from django.urls import path

from billing_platform.console import (
    advice_views,
    audit_views,
    batch_views,
    billing_views,
    dashboard_views,
    plan_views,
    settings_views,
    usage_views,
    views,
)

app_name = "console"

urlpatterns = [
    path("", dashboard_views.dashboard, name="dashboard"),
    path("signup/", views.signup, name="signup"),
    path("login/", auth_views.LoginView.as_view(template_name="console/login.html"),
         name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("org/switch/", views.switch_org, name="switch-org"),
    path("projects/", views.projects, name="projects"),
    path("projects/<str:project_id>/keys/", views.api_keys, name="api-keys"),
    path("projects/<str:project_id>/keys/<str:key_id>/revoke/", views.api_key_revoke,
         name="api-key-revoke"),
    path("members/", views.members, name="members"),
    path("members/<int:member_id>/role/", views.member_role, name="member-role"),
    path("invitations/<str:token>/", views.invitation_accept, name="invitation"),
    path("invoices/", views.invoices, name="invoices"),
    path("invoices/<str:invoice_id>/", views.invoice_document, name="invoice"),
    path("invoices/<str:invoice_id>/pdf/", views.invoice_document, {"fmt": "pdf"},
         name="invoice-pdf"),
    path("invoices/<str:invoice_id>/csv/", views.invoice_document, {"fmt": "csv"},
         name="invoice-csv"),
    path("plan-advice/", advice_views.plan_advice, name="plan-advice"),
    path("billing/", billing_views.billing, name="billing"),
    path("billing/card/", billing_views.card_form, name="billing-card"),
    path("billing/card/start/", billing_views.card_setup_start, name="billing-card-start"),
    path("billing/card/complete/", billing_views.card_setup_complete,
         name="billing-card-complete"),
    path("plan/", plan_views.plan, name="plan"),
    path("plan/subscribe/", plan_views.plan_change, name="plan-subscribe"),
    path("plan/<str:sub_id>/change/", plan_views.plan_change, name="plan-change"),
    path("plan/<str:sub_id>/cancel/", plan_views.plan_cancel, name="plan-cancel"),
    path("plan/<str:sub_id>/packs/", plan_views.pack_buy, name="plan-pack-buy"),
    path("settings/", settings_views.quota_settings, name="settings"),
    path("settings/billing-profile/", settings_views.billing_profile_save,
         name="billing-profile"),
    path("usage/", usage_views.usage, name="usage"),
    path("audit/", audit_views.audit_log, name="audit"),
    path("batches/", batch_views.batches, name="batches"),
    path("batches/<str:batch_id>/cancel/", batch_views.batch_cancel, name="batch-cancel"),
    path("files/<str:file_id>/", batch_views.batch_file, name="file"),
]
