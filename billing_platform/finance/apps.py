from django.apps import AppConfig


class FinanceConfig(AppConfig):
    name = "billing_platform.finance"
    label = "finance"
    verbose_name = "Finance workspace"
