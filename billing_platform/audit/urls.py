"""Audit log routes (read-only)."""

from django.urls import path

from billing_platform.audit import apis

urlpatterns = [
    path("organizations/<str:org_id>/audit_log/", apis.OrgAuditLogApi.as_view(),
         name="audit-log"),
    path("audit_log/", apis.PlatformAuditLogApi.as_view(), name="audit-log-all"),
]
