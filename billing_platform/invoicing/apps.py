from django.apps import AppConfig


class InvoicingConfig(AppConfig):
    name = "billing_platform.invoicing"
    label = "invoicing"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from prometheus_client import REGISTRY

        from billing_platform.invoicing.invariants import BillingInvariantCollector

        REGISTRY.register(BillingInvariantCollector())
