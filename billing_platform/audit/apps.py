from django.apps import AppConfig


class AuditConfig(AppConfig):
    name = "billing_platform.audit"
    label = "audit"
    verbose_name = "Audit log"
