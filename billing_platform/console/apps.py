from django.apps import AppConfig


class ConsoleConfig(AppConfig):
    name = "billing_platform.console"
    label = "console"
    default_auto_field = "django.db.models.BigAutoField"
