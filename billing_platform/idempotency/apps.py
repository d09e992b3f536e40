from django.apps import AppConfig


class IdempotencyConfig(AppConfig):
    name = "billing_platform.idempotency"
    label = "idempotency"
    verbose_name = "Idempotent requests"
