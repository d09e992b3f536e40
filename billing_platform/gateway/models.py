"""Files and batches of the OpenAI Batch API.

A batch's lines live in PostgreSQL, one row each, so progress survives any worker: workers
claim chunks of pending lines with ``FOR UPDATE SKIP LOCKED`` under a lease, and a line's
result, its state and its usage event payload are written in one statement.
"""

from __future__ import annotations

import secrets

from django.db import models


def _file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def _batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


class FilePurpose(models.TextChoices):
    BATCH = "batch", "Batch input"
    BATCH_OUTPUT = "batch_output", "Batch output"


class BatchStatus(models.TextChoices):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


ACTIVE_STATUSES = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING,
                   BatchStatus.CANCELLING)


class LineState(models.TextChoices):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"


class StoredFile(models.Model):
    """A JSONL file an org uploaded (purpose ``batch``) or a batch produced (``batch_output``).

    ``bytes`` is the size on disk; the content is at ``FILES_DIR / storage_path``.
    """

    public_id = models.CharField(max_length=40, unique=True, default=_file_id)
    organization = models.ForeignKey("accounts.Organization", on_delete=models.CASCADE,
                                     related_name="files")
    project = models.ForeignKey("accounts.Project", on_delete=models.SET_NULL, null=True,
                                related_name="files")
    purpose = models.CharField(max_length=16, choices=FilePurpose.choices)
    filename = models.CharField(max_length=255)
    bytes = models.PositiveBigIntegerField()
    lines = models.PositiveIntegerField(default=0)
    storage_path = models.CharField(max_length=255)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["organization", "-id"])]

    def __str__(self) -> str:
        return self.public_id


class Batch(models.Model):
    """One OpenAI batch: its input file, status timestamps and result files.

    ``principal`` is the API key's principal at creation (JSON): the key the batch runs and is
    metered as. Whether that key, its organization and its data zone still allow the batch is
    read afresh while it runs (``batch/standing.py``), never from this copy.
    """

    public_id = models.CharField(max_length=40, unique=True, default=_batch_id)
    organization = models.ForeignKey("accounts.Organization", on_delete=models.CASCADE,
                                     related_name="batches")
    project = models.ForeignKey("accounts.Project", on_delete=models.SET_NULL, null=True,
                                related_name="batches")
    api_key_id = models.BigIntegerField(null=True)
    principal = models.JSONField(default=dict)
    endpoint = models.CharField(max_length=64)
    model = models.CharField(max_length=200, blank=True)
    completion_window = models.CharField(max_length=8, default="24h")
    input_file = models.ForeignKey(StoredFile, on_delete=models.SET_NULL, null=True,
                                   related_name="+")
    output_file = models.ForeignKey(StoredFile, on_delete=models.SET_NULL, null=True,
                                    related_name="+")
    error_file = models.ForeignKey(StoredFile, on_delete=models.SET_NULL, null=True,
                                   related_name="+")
    status = models.CharField(max_length=16, choices=BatchStatus.choices,
                              default=BatchStatus.VALIDATING)
    errors = models.JSONField(null=True, blank=True)
    metadata = models.JSONField(null=True, blank=True)
    total = models.PositiveIntegerField(default=0)
    completed = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    in_progress_at = models.DateTimeField(null=True)
    finalizing_at = models.DateTimeField(null=True)
    completed_at = models.DateTimeField(null=True)
    failed_at = models.DateTimeField(null=True)
    expired_at = models.DateTimeField(null=True)
    cancelling_at = models.DateTimeField(null=True)
    cancelled_at = models.DateTimeField(null=True)
    # Last time a worker made progress (or waited for capacity); the sweep restarts a batch
    # whose runner went silent.
    heartbeat_at = models.DateTimeField(null=True)

    class Meta:
        indexes = [models.Index(fields=["organization", "-id"]),
                   models.Index(fields=["status"])]

    def __str__(self) -> str:
        return self.public_id


class BatchLine(models.Model):
    """One request of a batch. ``request_id`` is the usage event's idempotency key.

    ``usage`` holds the usage event of a completed line until it is appended to the metering
    stream (``metered``): written with the result in one statement, appended after, so a
    worker killed in between leaves an event the sweep appends, never a lost or double one.
    """

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="lines")
    line_no = models.PositiveIntegerField()
    custom_id = models.CharField(max_length=512)
    body = models.JSONField()
    state = models.CharField(max_length=16, choices=LineState.choices,
                             default=LineState.PENDING)
    lease_until = models.DateTimeField(null=True)
    lease_token = models.CharField(max_length=32, blank=True)
    attempts = models.PositiveSmallIntegerField(default=0)
    request_id = models.CharField(max_length=64, unique=True)
    status_code = models.PositiveSmallIntegerField(null=True)
    response = models.JSONField(null=True)
    error = models.JSONField(null=True)
    usage = models.JSONField(null=True)
    metered = models.BooleanField(default=False)
    finished_at = models.DateTimeField(null=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["batch", "line_no"], name="batch_line_no_unique"),
            models.UniqueConstraint(fields=["batch", "custom_id"],
                                    name="batch_line_custom_id_unique"),
        ]
        indexes = [models.Index(fields=["batch", "state", "line_no"]),
                   models.Index(fields=["metered"], condition=models.Q(
                       metered=False, state="completed"), name="batch_line_unmetered")]

    def __str__(self) -> str:
        return f"{self.batch_id}:{self.line_no}"


def _response_id() -> str:
    return f"resp_{secrets.token_hex(16)}"


class StoredResponse(models.Model):
    """One answer of the Responses API kept for ``previous_response_id`` and
    ``GET /v1/responses/{id}`` (``store`` true, the default), for the retention period.

    ``input_items`` are the turns this response added (``[{"role", "content"}]``, text only;
    ``instructions`` are not carried to the next response, as OpenAI does not carry them);
    ``output_text`` what the model answered; together with ``previous``'s they rebuild a
    conversation. ``body`` is the Response object as it was answered, ``usage`` its
    ``usage`` (the engine's counts, equal to the usage event ``request_id``'s). A response
    deleted or expired ends the chain of the ones that follow it (``previous`` becomes null).
    """

    public_id = models.CharField(max_length=40, unique=True, default=_response_id)
    organization = models.ForeignKey("accounts.Organization", on_delete=models.CASCADE,
                                     related_name="stored_responses")
    project = models.ForeignKey("accounts.Project", on_delete=models.SET_NULL, null=True,
                                related_name="stored_responses")
    previous = models.ForeignKey("self", on_delete=models.SET_NULL, null=True,
                                 related_name="+")
    request_id = models.CharField(max_length=64)
    model = models.CharField(max_length=200)
    input_items = models.JSONField(default=list)
    output_text = models.TextField(blank=True)
    usage = models.JSONField(default=dict)
    body = models.JSONField(default=dict)
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField()

    class Meta:
        indexes = [models.Index(fields=["expires_at"])]

    def __str__(self) -> str:
        return self.public_id
