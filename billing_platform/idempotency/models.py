"""The stored first result of each idempotent request."""

from __future__ import annotations

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.utils import timezone


class IdempotentRequest(models.Model):
    """One ``Idempotency-Key`` of one caller: what was asked and what was answered."""

    caller = models.CharField(max_length=40, help_text="user:<id> or api_key:<id>")
    key = models.CharField(max_length=255)
    fingerprint = models.CharField(max_length=64, help_text="SHA-256 of method, path and body")
    status_code = models.PositiveSmallIntegerField(null=True)
    body = models.JSONField(null=True, encoder=DjangoJSONEncoder)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["caller", "key"],
                                               name="one_result_per_idempotency_key")]
        indexes = [models.Index(fields=["created_at"])]

    def __str__(self) -> str:
        return f"{self.caller} {self.key}"
