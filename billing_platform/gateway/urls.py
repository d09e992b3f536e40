"""/v1 routes (OpenAI-compatible)."""

from django.urls import path

from billing_platform.gateway import apis

urlpatterns = [
    path("chat/completions", apis.chat_completions, name="v1-chat-completions"),
    path("completions", apis.completions, name="v1-completions"),
    path("models", apis.models, name="v1-models"),
    path("models/<path:model_id>", apis.model_detail, name="v1-model"),
]
