"""Batches: create, validate, claim, record, cancel, expire, finalize.

Life of a batch (OpenAI's statuses): ``validating`` (a worker parses the input file, see
validation.py; a bad file ends ``failed`` with line-level ``errors``) -> ``in_progress`` (lines
run; see runner.py) -> ``finalizing`` (output and error files written) -> ``completed``.
``cancel`` moves it to ``cancelling``: pending lines are dropped at once, lines in flight
finish and are kept, then ``cancelled``. Past ``expires_at`` the sweep moves it to ``expired``
with what finished. A batch whose key, organization or placement no longer allows it (see
standing.py) ends ``failed`` with the reason in ``errors``, keeping what finished.

Exactly-once: a line's result, its new state and its usage event are written by ONE
conditional UPDATE (``state = running AND lease_token = ours``), and the event is appended to
the metering stream afterwards under the line's request id (the stream's idempotency key: a
random platform id given to the line at validation, so nobody can report usage under it). A
worker killed before the UPDATE leaves a leased line that is claimed again when the lease runs
out; one killed after it leaves an unmetered line that the next flush appends. Lines that
failed, expired or were cancelled have no usage event: only completed lines are billed.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Count, F, Q, QuerySet
from django.utils import timezone

from billing_platform.accounts.selectors import KeyPrincipal
from billing_platform.errors import Conflict, InvalidRequest, NotFound
from billing_platform.gateway.batch import files
from billing_platform.gateway.batch.validation import ENDPOINTS
from billing_platform.gateway.batch.validation import batch_validate as batch_validate
from billing_platform.gateway.models import (
    ACTIVE_STATUSES,
    Batch,
    BatchLine,
    BatchStatus,
    FilePurpose,
    LineState,
    StoredFile,
)

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3


# -- create, read ------------------------------------------------------------------------------

def batch_create(*, principal: KeyPrincipal, input_file_id: Any, endpoint: Any,
                 completion_window: Any, metadata: Any = None) -> Batch:
    """Create a batch in ``validating`` and enqueue its validation."""
    if not isinstance(input_file_id, str) or not input_file_id:
        raise InvalidRequest("'input_file_id' is required.", param="input_file_id")
    if not isinstance(endpoint, str) or endpoint not in ENDPOINTS:
        raise InvalidRequest(f"Invalid endpoint {endpoint!r}; expected one of "
                             f"{', '.join(ENDPOINTS)}.", param="endpoint")
    if (not isinstance(completion_window, str)
            or completion_window not in settings.BATCH_COMPLETION_WINDOWS):
        raise InvalidRequest(f"Invalid completion_window {completion_window!r}; expected '24h'.",
                             param="completion_window")
    if metadata is not None and (
            not isinstance(metadata, dict) or len(metadata) > 16
            or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str)
                       and len(v) <= 512 for k, v in metadata.items())):
        raise InvalidRequest("'metadata' must be an object of at most 16 string keys (64 chars) "
                             "and string values (512 chars).", param="metadata")
    file = files.file_get(org_id=principal.org_id, file_id=input_file_id)
    if file.purpose != FilePurpose.BATCH:
        raise InvalidRequest(f"File {input_file_id} has purpose {file.purpose!r}; a batch needs a "
                             "file uploaded with purpose 'batch'.", param="input_file_id")
    window = settings.BATCH_COMPLETION_WINDOWS[completion_window]
    batch = Batch.objects.create(
        organization_id=principal.org_id, project_id=principal.project_id,
        api_key_id=principal.key_id, principal=asdict(principal), endpoint=endpoint,
        completion_window=completion_window, input_file=file, metadata=metadata,
        expires_at=timezone.now() + timedelta(seconds=window), heartbeat_at=timezone.now())
    transaction.on_commit(lambda: _enqueue_start(batch.pk))
    return batch


def _enqueue_start(batch_id: int) -> None:
    from kombu.exceptions import OperationalError

    from billing_platform.gateway import tasks

    try:
        tasks.batch_start.delay(batch_id)
    except OperationalError as exc:  # broker down: the sweep starts it when it is back
        log.warning("batch %s: could not enqueue validation (%r); the sweep will", batch_id,
                    exc)


def batches_for_org(*, org_id: int) -> QuerySet[Batch]:
    """Return the organization's batches, newest first."""
    return Batch.objects.filter(organization_id=org_id).select_related(
        "input_file", "output_file", "error_file").order_by("-id")


def batch_get(*, org_id: int, batch_id: str) -> Batch:
    """Return one of the organization's batches, or raise NotFound."""
    batch = batches_for_org(org_id=org_id).filter(public_id=batch_id).first()
    if batch is None:
        raise NotFound(f"No batch found with id '{batch_id}'.", param="batch_id",
                       code="batch_not_found")
    return batch


def _ts(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value else None


def batch_object(batch: Batch) -> dict[str, Any]:
    """Return the OpenAI Batch object."""
    def file_id(file: StoredFile | None) -> str | None:
        return file.public_id if file else None

    return {
        "id": batch.public_id, "object": "batch", "endpoint": batch.endpoint,
        "model": batch.model or None,
        "errors": {"object": "list", "data": batch.errors} if batch.errors else None,
        "input_file_id": file_id(batch.input_file), "completion_window": batch.completion_window,
        "status": batch.status, "output_file_id": file_id(batch.output_file),
        "error_file_id": file_id(batch.error_file),
        "created_at": _ts(batch.created_at), "in_progress_at": _ts(batch.in_progress_at),
        "expires_at": _ts(batch.expires_at), "finalizing_at": _ts(batch.finalizing_at),
        "completed_at": _ts(batch.completed_at), "failed_at": _ts(batch.failed_at),
        "expired_at": _ts(batch.expired_at), "cancelling_at": _ts(batch.cancelling_at),
        "cancelled_at": _ts(batch.cancelled_at),
        "request_counts": {"total": batch.total, "completed": batch.completed,
                           "failed": batch.failed},
        "metadata": batch.metadata,
    }


# -- in_progress: claims and results -----------------------------------------------------------

def batch_heartbeat(*, batch_id: int) -> str | None:
    """Record that a runner is alive; return the batch's status (None if it is gone)."""
    with connection.cursor() as cur:
        cur.execute("UPDATE gateway_batch SET heartbeat_at = %s WHERE id = %s RETURNING status",
                    [timezone.now(), batch_id])
        row = cur.fetchone()
    return row[0] if row else None


def batch_lines_claim(*, batch_id: int, limit: int) -> tuple[str, list[BatchLine]]:
    """Lease up to ``limit`` runnable lines (pending, or leased by a worker that died)."""
    token = secrets.token_hex(8)
    lease_until = timezone.now() + timedelta(seconds=settings.BATCH_LEASE_S)
    # Lines whose lease ran out first, then pending ones, each read in line order straight
    # off the (batch, state, line_no) index: one scan with "pending OR expired" sorted every
    # runnable line of the batch per claim (16 ms for 20,000 lines, once a second).
    with connection.cursor() as cur:
        cur.execute(
            """
            WITH expired AS (
                SELECT id FROM gateway_batchline
                WHERE batch_id = %s AND state = %s AND lease_until < now()
                ORDER BY line_no LIMIT %s FOR UPDATE SKIP LOCKED),
            pending AS (
                SELECT id FROM gateway_batchline WHERE batch_id = %s AND state = %s
                ORDER BY line_no LIMIT (%s - (SELECT count(*) FROM expired))
                FOR UPDATE SKIP LOCKED)
            UPDATE gateway_batchline SET state = %s, lease_until = %s, lease_token = %s,
                   attempts = attempts + 1
            WHERE id IN (SELECT id FROM expired UNION ALL SELECT id FROM pending)
              AND EXISTS (SELECT 1 FROM gateway_batch b WHERE b.id = %s AND b.status = %s)
            RETURNING id
            """,
            [batch_id, LineState.RUNNING, limit, batch_id, LineState.PENDING, limit,
             LineState.RUNNING, lease_until, token, batch_id, BatchStatus.IN_PROGRESS])
        ids = [row[0] for row in cur.fetchall()]
    return token, list(BatchLine.objects.filter(id__in=ids).order_by("line_no"))


@dataclass
class LineOutcome:
    """What running one line produced; ``retry`` hands the line back to run again later."""

    line_id: int
    state: str = LineState.COMPLETED
    status_code: int | None = None
    response: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    retry: bool = False
    started: bool = True  # False: claimed but never sent (handing it back costs no attempt)
    stop: bool = False  # a hard budget or token plan refused: end the batch


def batch_lines_record(*, batch_id: int, token: str, outcomes: list[LineOutcome]) -> int:
    """Write the outcomes of lines this worker still holds; meter the completed ones.

    One statement for the whole chunk, conditional on each line still being ``running``
    under our lease: a line whose lease was lost (expired, cancelled, or claimed again) is
    left alone and its result dropped unbilled. Lines handed back (``retry``) become pending
    again, or cancelled if the batch is being cancelled meanwhile (a pending line would hold
    the cancel open). Return how many finished lines were recorded.
    """
    now = timezone.now()
    back = [o for o in outcomes if o.retry]
    done = [o for o in outcomes if not o.retry]
    recorded: list[tuple[int, str]] = []
    with transaction.atomic(), connection.cursor() as cur:
        if back:
            cur.execute(
                """
                UPDATE gateway_batchline AS l
                SET state = CASE WHEN b.status = %s THEN %s ELSE %s END,
                    finished_at = CASE WHEN b.status = %s THEN NULL ELSE %s::timestamptz END,
                    lease_until = NULL, lease_token = '',
                    attempts = l.attempts - (l.id = ANY(%s::bigint[]))::int
                FROM gateway_batch AS b
                WHERE b.id = %s AND l.batch_id = b.id AND l.id = ANY(%s::bigint[])
                  AND l.state = %s AND l.lease_token = %s
                """,
                [BatchStatus.IN_PROGRESS, LineState.PENDING, LineState.CANCELLED,
                 BatchStatus.IN_PROGRESS, now, [o.line_id for o in back if not o.started],
                 batch_id, [o.line_id for o in back], LineState.RUNNING, token])
        if done:
            values = ", ".join(["(%s, %s, %s, %s, %s, %s)"] * len(done))
            params: list[Any] = []
            for o in done:
                params += [o.line_id, o.state, o.status_code,
                           None if o.response is None else json.dumps(o.response),
                           None if o.error is None else json.dumps(o.error),
                           None if o.usage is None else json.dumps(o.usage)]
            cur.execute(
                f"""
                UPDATE gateway_batchline AS l
                SET state = v.state, status_code = v.status_code::int,
                    response = v.response::jsonb, error = v.error::jsonb,
                    usage = v.usage::jsonb, metered = false, finished_at = %s,
                    lease_until = NULL
                FROM (VALUES {values}) AS v(id, state, status_code, response, error, usage)
                WHERE l.id = v.id::bigint AND l.state = %s AND l.lease_token = %s
                RETURNING l.id, l.state
                """,  # noqa: S608 - only placeholders are interpolated
                [now, *params, LineState.RUNNING, token])
            recorded = cur.fetchall()
        completed = [line_id for line_id, state in recorded if state == LineState.COMPLETED]
        if recorded:
            Batch.objects.filter(pk=batch_id).update(
                completed=F("completed") + len(completed),
                failed=F("failed") + len(recorded) - len(completed), heartbeat_at=now)
    if completed:
        # Meter from the outcomes in hand (reading them back cost the worker more than the
        # write). The lines are committed first, so a crash here leaves them unmetered for
        # the sweep's batch_usage_flush, never metered without a recorded result.
        usage = {o.line_id: o.usage for o in done}
        _usage_append(ids=completed, usage_list=[usage[i] for i in completed if usage[i]])
    return len(recorded)


def batch_lines_stop(*, batch_id: int, error: dict[str, Any] | None) -> int:
    """Fail every pending line with ``error`` (a budget stopped the batch); return how many."""
    now = timezone.now()
    with transaction.atomic():
        n = BatchLine.objects.filter(batch_id=batch_id, state=LineState.PENDING).update(
            state=LineState.FAILED, error=error, finished_at=now)
        Batch.objects.filter(pk=batch_id).update(failed=F("failed") + n)
    return n


def _usage_append(*, ids: list[int], usage_list: list[dict[str, Any]]) -> None:
    """Append these lines' usage events, then mark the lines metered.

    Idempotent: each line's request id is its event's key, so a retry after a crash between
    the append and the update records nothing twice.
    """
    from metering.services import usage_events_append

    usage_events_append(usage_list)
    BatchLine.objects.filter(id__in=ids).update(metered=True)


def batch_usage_flush(*, batch_id: int | None = None) -> int:
    """Append the usage events of completed, not yet metered lines; return how many."""
    lines = BatchLine.objects.filter(state=LineState.COMPLETED, metered=False)
    if batch_id is not None:
        lines = lines.filter(batch_id=batch_id)
    done, usage_list, total = [], [], 0

    def flush() -> None:
        _usage_append(ids=done, usage_list=usage_list)
        done.clear()
        usage_list.clear()

    for line_id, usage in lines.values_list("id", "usage").iterator(chunk_size=2000):
        if usage:
            usage_list.append(usage)
        done.append(line_id)
        total += 1
        if len(done) >= 500:
            flush()
    if done:
        flush()
    return total


# -- cancel, expire, finalize ------------------------------------------------------------------

def batch_cancel(*, batch: Batch) -> Batch:
    """Cancel a batch: drop pending lines now, keep finished ones; ends ``cancelled``."""
    now = timezone.now()
    with transaction.atomic():
        locked = Batch.objects.select_for_update().get(pk=batch.pk)
        if locked.status == BatchStatus.VALIDATING:
            Batch.objects.filter(pk=batch.pk).update(
                status=BatchStatus.CANCELLED, cancelling_at=now, cancelled_at=now)
        elif locked.status == BatchStatus.IN_PROGRESS:
            Batch.objects.filter(pk=batch.pk).update(status=BatchStatus.CANCELLING,
                                                     cancelling_at=now)
            BatchLine.objects.filter(batch_id=batch.pk, state=LineState.PENDING).update(
                state=LineState.CANCELLED, finished_at=now)
        elif locked.status not in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
            raise Conflict(f"Cannot cancel a batch with status '{locked.status}'.",
                           code="batch_not_cancellable")
    batch_finalize_if_done(batch_id=batch.pk)
    return batches_for_org(org_id=batch.organization_id).get(pk=batch.pk)


def batch_expire(*, batch_id: int) -> None:
    """End an overdue batch as ``expired``: unfinished lines are dropped, finished kept."""
    now = timezone.now()
    with transaction.atomic():
        locked = Batch.objects.select_for_update().get(pk=batch_id)
        if locked.status not in ACTIVE_STATUSES or locked.expires_at > now:
            return
        BatchLine.objects.filter(
            batch_id=batch_id, state__in=(LineState.PENDING, LineState.RUNNING)).update(
            state=LineState.EXPIRED, finished_at=now, lease_token="")
        Batch.objects.filter(pk=batch_id).update(status=BatchStatus.FINALIZING,
                                                 finalizing_at=now)
    _finalize(batch_id=batch_id, final=BatchStatus.EXPIRED, stamp="expired_at")


def batch_fail(*, batch_id: int, error: dict[str, Any]) -> bool:
    """End a running batch ``failed`` with ``error`` as its ``errors`` (its key, organization
    or placement no longer allows it); return whether it was failed now.

    Lines not finished are not run: pending ones, and running ones some other worker holds
    (its late result is dropped unbilled, as after an expiry), fail with the same code.
    Finished lines are kept, in the output file, metered once. ``failed`` rather than
    ``cancelled``: in OpenAI's Batch API ``cancelled`` is what the caller asked for, while
    ``failed`` is the platform refusing the batch, and carries ``errors`` saying why.
    """
    now = timezone.now()
    line_error = {"code": error["code"], "message": error["message"]}
    with transaction.atomic():
        locked = Batch.objects.select_for_update().filter(pk=batch_id).first()
        if locked is None or locked.status != BatchStatus.IN_PROGRESS:
            return False
        BatchLine.objects.filter(
            batch_id=batch_id, state__in=(LineState.PENDING, LineState.RUNNING)).update(
            state=LineState.FAILED, error=line_error, finished_at=now, lease_until=None,
            lease_token="")
        Batch.objects.filter(pk=batch_id).update(status=BatchStatus.FINALIZING,
                                                 finalizing_at=now, errors=[error])
    log.warning("batch %s failed: %s", locked.public_id, error["code"])
    _finalize(batch_id=batch_id, final=BatchStatus.FAILED, stamp="failed_at")
    return True


def batch_finalize_if_done(*, batch_id: int) -> bool:
    """Finish the batch if no line is left to run; return True if it was finalized now."""
    now = timezone.now()
    with transaction.atomic():
        locked = Batch.objects.select_for_update().filter(pk=batch_id).first()
        if locked is None:
            return False
        unfinished = BatchLine.objects.filter(batch_id=batch_id)
        if locked.status == BatchStatus.IN_PROGRESS:
            if unfinished.filter(state__in=(LineState.PENDING, LineState.RUNNING)).exists():
                return False
            final, stamp = BatchStatus.COMPLETED, "completed_at"
        elif locked.status == BatchStatus.CANCELLING:
            # Lines of a worker that died while cancelling will never report: drop them.
            unfinished.filter(state=LineState.RUNNING, lease_until__lt=now).update(
                state=LineState.CANCELLED, finished_at=now, lease_token="")
            if unfinished.filter(state__in=(LineState.PENDING, LineState.RUNNING)).exists():
                return False
            final, stamp = BatchStatus.CANCELLED, "cancelled_at"
        else:
            return False
        Batch.objects.filter(pk=batch_id).update(status=BatchStatus.FINALIZING,
                                                 finalizing_at=locked.finalizing_at or now)
    _finalize(batch_id=batch_id, final=final, stamp=stamp)
    return True


def _result_rows(batch: Batch, states: tuple[str, ...]) -> Iterator[bytes]:
    lines = (BatchLine.objects.filter(batch_id=batch.pk, state__in=states).order_by("line_no")
             .values_list("line_no", "custom_id", "request_id", "state", "status_code",
                          "response", "error"))
    hexid = batch.public_id.removeprefix("batch_")
    for line_no, custom_id, request_id, state, status_code, response, error in lines.iterator(
            chunk_size=2000):
        if state == LineState.EXPIRED:
            error = {"code": "batch_expired", "message": "This line could not be executed "
                     "before the completion window expired."}
        elif state == LineState.CANCELLED:
            error = {"code": "batch_cancelled", "message": "This line was not executed "
                     "because the batch was cancelled."}
        row = {
            "id": f"batch_req_{hexid}{line_no:06d}", "custom_id": custom_id,
            "response": ({"status_code": status_code, "request_id": request_id,
                          "body": response} if status_code else None),
            "error": error if state != LineState.COMPLETED else None,
        }
        yield json.dumps(row, separators=(",", ":")).encode()


def _finalize(*, batch_id: int, final: str, stamp: str) -> None:
    """Meter what completed, write the output and error files, set the final status."""
    batch_usage_flush(batch_id=batch_id)
    batch = Batch.objects.select_related("organization").get(pk=batch_id)
    if batch.status != BatchStatus.FINALIZING:
        return
    states = BatchLine.objects.filter(batch_id=batch_id).values_list("state", flat=True)
    present = set(states.distinct())
    common = {"org_id": batch.organization_id, "org_public_id": batch.organization.public_id,
              "project_id": batch.project_id}
    output = error = None
    if LineState.COMPLETED in present:
        output = files.file_write_lines(
            **common, filename=f"{batch.public_id}_output.jsonl",
            rows=_result_rows(batch, (LineState.COMPLETED,)))
    bad = (LineState.FAILED, LineState.EXPIRED, LineState.CANCELLED)
    if present & set(bad):
        error = files.file_write_lines(**common, filename=f"{batch.public_id}_error.jsonl",
                                       rows=_result_rows(batch, bad))
    counts = dict(BatchLine.objects.filter(batch_id=batch_id).values_list("state")
                  .annotate(n=Count("id")))
    updated = Batch.objects.filter(pk=batch_id, status=BatchStatus.FINALIZING).update(
        status=final, output_file=output, error_file=error,
        completed=counts.get(LineState.COMPLETED, 0), failed=counts.get(LineState.FAILED, 0),
        **{stamp: timezone.now()})
    if not updated:  # another finalizer won the race; drop our copies
        for file in (output, error):
            if file is not None:
                files.file_delete(file=file)


def batch_sweep() -> dict[str, int]:
    """Expire overdue batches, finish cancelling ones, restart batches whose runner died."""
    from billing_platform.gateway import tasks

    now = timezone.now()
    report = {"expired": 0, "finalized": 0, "restarted": 0}
    for batch_id in Batch.objects.filter(status__in=ACTIVE_STATUSES,
                                         expires_at__lte=now).values_list("id", flat=True):
        batch_expire(batch_id=batch_id)
        report["expired"] += 1
    for batch_id in Batch.objects.filter(
            status__in=(BatchStatus.CANCELLING, BatchStatus.IN_PROGRESS)).values_list(
            "id", flat=True):
        report["finalized"] += batch_finalize_if_done(batch_id=batch_id)
    stale = now - timedelta(seconds=4 * settings.BATCH_SWEEP_S)
    for batch_id, status in Batch.objects.filter(
            Q(heartbeat_at__lt=stale) | Q(heartbeat_at__isnull=True),
            status__in=(BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)).values_list(
            "id", "status"):
        Batch.objects.filter(pk=batch_id).update(heartbeat_at=now)
        if status == BatchStatus.VALIDATING:
            tasks.batch_start.delay(batch_id)
        else:
            tasks.batch_run.delay(batch_id)
        report["restarted"] += 1
    batch_usage_flush()
    return report
