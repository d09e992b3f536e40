from django.apps import AppConfig


class InvoicingConfig(AppConfig):
    name = "billing_platform.invoicing"
    label = "invoicing"
    default_auto_field = "django.db.models.BigAutoField"
