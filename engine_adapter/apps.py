from django.apps import AppConfig


class EngineAdapterConfig(AppConfig):
    name = "engine_adapter"
    label = "engine_adapter"
    default_auto_field = "django.db.models.BigAutoField"
