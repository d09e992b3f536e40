"""Audit rows: who did what to which object, with the state before and after.

Rows are append-only. Django refuses to update or delete them, and so does PostgreSQL: a
trigger (migration 0001) rejects UPDATE and DELETE, so not even raw SQL or the admin can edit
history. Foreign keys carry no database constraint and never cascade: deleting an organization,
user or key leaves its history in place, and ``actor_label`` keeps who acted in words.
"""

from __future__ import annotations

from typing import Any, NoReturn

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.utils import timezone

from billing_platform.accounts.models import ApiKey, Organization, User, public_id


def _audit_id() -> str:
    return public_id("aud")


class AuditEvent(models.Model):
    """One privileged or money-moving action, written in the action's own transaction."""

    public_id = models.CharField(max_length=40, unique=True, default=_audit_id, editable=False)
    organization = models.ForeignKey(Organization, null=True, blank=True, db_constraint=False,
                                     on_delete=models.DO_NOTHING, related_name="+")
    actor_user = models.ForeignKey(User, null=True, blank=True, db_constraint=False,
                                   on_delete=models.DO_NOTHING, related_name="+")
    actor_key = models.ForeignKey(ApiKey, null=True, blank=True, db_constraint=False,
                                  on_delete=models.DO_NOTHING, related_name="+")
    actor_label = models.CharField(max_length=200, help_text="email, key prefix or 'system'")
    action = models.CharField(max_length=60, help_text="<entity>.<verb>, e.g. api_key.create")
    target = models.CharField(max_length=80, blank=True, help_text="public id acted on")
    before = models.JSONField(null=True, blank=True, encoder=DjangoJSONEncoder)
    after = models.JSONField(null=True, blank=True, encoder=DjangoJSONEncoder)
    request_id = models.CharField(max_length=64, blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        indexes = [models.Index(fields=["organization", "-created_at"]),
                   models.Index(fields=["action", "-created_at"])]

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M:%S} {self.actor_label} {self.action} {self.target}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self._state.adding:
            raise TypeError("Audit rows are append-only; write a new row instead.")
        super().save(*args, **kwargs)

    def delete(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("Audit rows are append-only and cannot be deleted.")

    @property
    def actor_kind(self) -> str:
        return "user" if self.actor_user_id else "api_key" if self.actor_key_id else "system"
