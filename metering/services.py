"""Writes of the metering app: append a usage event durably, record batches, replay the spool,
retry dead letters (staff, audited), create and retire monthly partitions.

``usage_event_append`` is what the gateway calls before a response ends. It tries, in order:

1. ``XADD`` to the Redis stream (the consumer records it within about a second);
2. when Redis fails, or the stream is at its cap (``stream.StreamFull``: the consumer is far
   behind), the direct PostgreSQL write the consumer itself uses (same dedup);
3. when PostgreSQL fails too, an fsync'd line in the local spool, replayed later.

It returns which one took the event. A path that fails after it may have succeeded (an XADD
that timed out after Redis applied it) is harmless: the request id makes the second copy a
duplicate wherever the two meet. When even the spool cannot be written it raises
``UsageNotRecorded``: the event exists nowhere, and the caller must treat the request as failed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, cast

import redis
from asgiref.sync import sync_to_async
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from billing_platform.audit.services import audit_record
from billing_platform.errors import DomainError, InvalidRequest, NotFound
from metering import conf, events, partitions, recording, retention, spool, stream
from metering.events import UsageEventData
from metering.metrics import APPENDS, ID_CONFLICTS, STREAM_FULL
from metering.models import UsageDeadLetter, UsageEventId
from metering.recording import RecordResult

log = logging.getLogger(__name__)

AppendPath = Literal["redis", "postgres", "spool"]


class UsageNotRecorded(DomainError):
    """Redis, PostgreSQL and the local spool all refused the event."""

    code = "usage_not_recorded"
    status = 503


_spool_writers: dict[str, spool.SpoolWriter] = {}


def _spool_writer() -> spool.SpoolWriter:
    directory = conf.spool_dir()
    writer = _spool_writers.get(str(directory))
    if writer is None:
        writer = _spool_writers.setdefault(str(directory), spool.SpoolWriter(directory))
    return writer


def _append_without_redis(data: Sequence[UsageEventData], payloads: Sequence[bytes]
                          ) -> AppendPath:
    first = data[0].request_id + (f" and {len(data) - 1} more" if len(data) > 1 else "")
    try:
        recording.record_events(data, origin="fallback")
    except Exception as exc:  # whatever stops PostgreSQL taking them, the spool keeps them
        recording.close_broken_connection(exc)
        log.warning("usage event %s: PostgreSQL did not take it either (%s); spooling it",
                    first, exc)
    else:
        APPENDS.labels("postgres").inc(len(data))
        return "postgres"
    try:
        writer = _spool_writer()
        for payload in payloads:
            writer.append(payload)
    except OSError as exc:
        log.error("usage event %s could not be recorded anywhere: %s", first, exc)
        APPENDS.labels("lost").inc(len(data))
        raise UsageNotRecorded(f"Usage event {first} could not be recorded.") from exc
    APPENDS.labels("spool").inc(len(data))
    return "spool"


def _stream_failed(exc: redis.RedisError, count: int) -> None:
    """Note that the stream did not take ``count`` events; the caller writes them elsewhere."""
    stream.breaker.trip()
    if isinstance(exc, stream.StreamFull):
        STREAM_FULL.inc(count)
        log.warning("usage stream full (%s): the ingest consumer is behind or down; writing "
                    "usage to PostgreSQL directly", exc)
    else:
        log.warning("usage stream unavailable (%s); writing to PostgreSQL", exc)


def usage_event_append(event: UsageEventData | Mapping[str, Any]) -> AppendPath:
    """Append one usage event durably; return where it went: redis, postgres or spool.

    ``event`` is a ``UsageEventData`` or a dict of its fields (see ``metering.events``).
    Raise ``InvalidRequest`` for an invalid event, ``UsageNotRecorded`` when nothing took it.
    """
    # never None: that is only the answer to an empty list
    return cast(AppendPath, usage_events_append([event]))


def usage_events_append(event_list: Sequence[UsageEventData | Mapping[str, Any]]
                        ) -> AppendPath | None:
    """Append several usage events durably in one round trip; return where they went.

    Same paths and guarantees as ``usage_event_append`` (for callers that produce events in
    groups: a batch runner's finished lines). When the stream fails part way, all of them go
    to PostgreSQL: those already on the stream become duplicates there, recorded once.
    Return None for an empty list.
    """
    if not event_list:
        return None
    data = [events.normalize(event) for event in event_list]
    payloads = [events.encode(d) for d in data]
    if stream.breaker.allow():
        try:
            _append_by_shard(payloads, [d.org_id for d in data])
        except redis.RedisError as exc:
            _stream_failed(exc, len(payloads))
        else:
            APPENDS.labels("redis").inc(len(payloads))
            return "redis"
    return _append_without_redis(data, payloads)


def _append_by_shard(payloads: Sequence[bytes], org_ids: Sequence[int]) -> None:
    """Append payloads to their organizations' streams, one round trip per shard (one in
    all with one stream); raise what the first failing shard raised."""
    by_key: dict[str, list[bytes]] = {}
    for payload, org_id in zip(payloads, org_ids, strict=True):
        by_key.setdefault(conf.stream_key_of(org_id), []).append(payload)
    for key, group in by_key.items():
        stream.append_many(group, key=key)


async def ausage_event_append(event: UsageEventData | Mapping[str, Any]) -> AppendPath:
    """Async ``usage_event_append`` for the gateway: XADD on the loop, fallbacks in a thread."""
    data = events.normalize(event)
    payload = events.encode(data)
    if stream.breaker.allow():
        try:
            await stream.aappend(payload, key=conf.stream_key_of(data.org_id))
        except redis.RedisError as exc:
            _stream_failed(exc, 1)
        else:
            APPENDS.labels("redis").inc()
            return "redis"
    # Not thread-sensitive: asgiref's one shared thread keeps a connection nothing checks, so a
    # PostgreSQL restart left this fallback failing (to the spool) for good; the gateway's
    # default executor checks each job's connection (gateway/db_connections.py).
    return await sync_to_async(_append_without_redis, thread_sensitive=False)([data], [payload])


def usage_events_record(event_list: Sequence[UsageEventData], *, origin: str) -> RecordResult:
    """Record already-validated events in PostgreSQL now, exactly once; say what happened."""
    return recording.record_events(event_list, origin=origin)


def _platform_id_claims(event_list: Sequence[UsageEventData]
                        ) -> dict[recording.Key, tuple[UsageEventData, str]]:
    """Return the external events whose own id is a platform request id, with why."""
    claims: dict[recording.Key, tuple[UsageEventData, str]] = {}
    unchecked: dict[tuple[int, str], UsageEventData] = {}
    for ev in event_list:
        own = events.caller_event_id(ev.request_id)
        if events.looks_like_platform_id(own):
            # read off a response (x-request-id, a batch output line) before, or after, the
            # platform metered it: either way it is not this caller's id to report
            claims[ev.key] = (ev, "has the form of a platform request id")
        elif not own.startswith(events.EXTERNAL_PREFIX):  # that one is an external event's
            unchecked.setdefault((ev.org_id, own), ev)
    if unchecked:
        taken = UsageEventId.objects.filter(
            organization_id__in={org for org, _ in unchecked},
            request_id__in={own for _, own in unchecked},
        ).values_list("organization_id", "request_id")
        for key in taken:
            if key in unchecked:
                ev = unchecked[key]
                claims[ev.key] = (ev, "is the request id of an event the platform metered")
    return claims


UPSERT_CONFLICT = """
INSERT INTO usage_id_conflict (organization_id, request_id, source, reason, reported_by,
                               payload, attempts, first_seen_at, last_seen_at)
VALUES (%s, %s, %s, %s, %s, %s, 1, now(), now())
ON CONFLICT ON CONSTRAINT usage_id_conflict_key DO UPDATE SET
    attempts = usage_id_conflict.attempts + 1, last_seen_at = now(),
    reason = EXCLUDED.reason, reported_by = EXCLUDED.reported_by, payload = EXCLUDED.payload
"""


def _event_json(ev: UsageEventData) -> str:
    return json.dumps({name: getattr(ev, name) for name in events.FIELDS}, default=str)


def _id_conflicts_record(claims: dict[recording.Key, tuple[UsageEventData, str]], *,
                         reported_by: str) -> None:
    """Keep each refused claim in ``usage_id_conflict``, log it and count it."""
    rows = []
    for ev, reason in claims.values():
        own = events.caller_event_id(ev.request_id)
        log.warning("usage event %r of organization %s refused: its id %s (reported by %s)",
                    own, ev.org_id, reason, reported_by or "unknown")
        ID_CONFLICTS.labels(source=ev.source).inc()
        rows.append((ev.org_id, own, ev.source, f"The id {reason}.", reported_by[:254],
                     _event_json(ev)))
    rows.sort(key=lambda r: (r[0], r[1]))  # concurrent callers lock rows in one order
    with transaction.atomic(), connection.cursor() as cur:
        cur.executemany(UPSERT_CONFLICT, rows)


def usage_events_record_external(event_list: Sequence[UsageEventData], *, reported_by: str = ""
                                 ) -> RecordResult:
    """Record events reported through the usage API; refuse those claiming a platform id.

    The events' ids are in the external namespace (``events.external_request_id``), so they
    can never take a platform event's key. An event whose own id is nonetheless a platform
    request id (one metered for its organization, or one of the platform's form, read off a
    response whose usage has not landed yet) is an attempt to pass a platform event off as
    the caller's: it is not recorded, comes back in ``conflicts``, and is kept (with the
    number of attempts) in ``UsageIdConflict``, logged and counted. The rest is recorded as
    ``usage_events_record`` does; a retried call is still answered with duplicates.
    """
    claims = _platform_id_claims(event_list)
    if claims:
        _id_conflicts_record(claims, reported_by=reported_by)
    rest = [ev for ev in event_list if ev.key not in claims]
    result = recording.record_events(rest, origin="api") if rest else RecordResult()
    result.conflicts += list(claims)
    return result


def _decode_or_dead_letter(lines: Iterable[bytes], origin: str) -> list[events.Row]:
    good = []
    for line in lines:
        try:
            good.append(events.decode_row(line))
        except InvalidRequest as exc:
            UsageDeadLetter.objects.create(payload=line.decode(errors="replace"),
                                           error=exc.message, origin=origin)
    return good


def _org_of(line: bytes) -> int:
    """Return the organization of a spooled event (0, the first shard, for one that does not
    decode: the consumer dead-letters it)."""
    try:
        return int(events.decode_row(line)[events.I_ORG])
    except (InvalidRequest, ValueError, TypeError, IndexError):
        return 0


def _spool_sink(lines: list[bytes]) -> None:
    """Make spooled lines durable: record them in PostgreSQL, else put them on the stream."""
    try:
        recording.record_rows(_decode_or_dead_letter(lines, "spool"), origin="spool")
    except Exception as exc:
        recording.close_broken_connection(exc)
        log.warning("spool replay: PostgreSQL unavailable (%s); trying the stream", exc)
        # raises if Redis is down too: the file is kept
        _append_by_shard(lines, [_org_of(line) for line in lines])


def usage_spool_replay() -> spool.ReplayReport:
    """Replay this host's spool files into PostgreSQL (or the stream); delete what is done."""
    report = spool.replay(conf.spool_dir(), _spool_sink)
    if report.files or report.left:
        log.info("usage spool replay: %d file(s), %d event line(s), %d left for later",
                 report.files, report.lines, report.left)
    return report


def usage_partitions_ensure(*, months_ahead: int = 2) -> list[str]:
    """Create this month's usage_event partition and the next ``months_ahead``."""
    return partitions.ensure_ahead(months_ahead=months_ahead)


def usage_partitions_retire(*, held: retention.HeldFn, now: datetime | None = None
                            ) -> retention.RetireReport:
    """Apply the usage retention horizon: archive and drop the old months ``held`` does not
    keep, delete the idempotency keys before the horizon (``metering.retention``)."""
    return retention.retire(held=held, now=now)


DeadLetterOutcome = Literal["recorded", "duplicate", "already_resolved", "failed"]


@dataclass(frozen=True)
class DeadLetterRetry:
    """What one retry of a dead letter did."""

    letter_id: int
    outcome: DeadLetterOutcome
    request_id: str | None  # None: the payload is not readable
    error: str = ""  # why it failed again


def usage_dead_letter_retry(*, letter_id: int, acting_user: Any) -> DeadLetterRetry:
    """Record one dead-lettered event again (after its cause was fixed); resolve it if it is in.

    Safe to repeat and to run concurrently: the event goes through the normal record path,
    whose exactly-once key (organization, request id) makes a second recording of it a
    ``duplicate`` that changes nothing; a resolved letter is left alone
    (``already_resolved``). A letter the rater or the data refuses again stays unresolved with
    the new error (``failed``). Each retry writes one audit row, in the transaction that
    resolves the letter (the recording is metering's own transaction, before it: a retry cut
    off between the two is resolved by the next one, as a duplicate). Raises ``NotFound`` for
    an unknown letter, and the record path's transient errors (PostgreSQL away) as they come.
    """
    letter = (UsageDeadLetter.objects.filter(pk=letter_id).first()
              if 0 < letter_id < 2**63 else None)  # a forged id past bigint is unknown too
    if letter is None:
        raise NotFound("No such dead letter.")
    request_id, org_id, error = None, None, ""
    outcome: DeadLetterOutcome = "already_resolved"
    if letter.resolved_at is None:
        try:
            data = events.decode(letter.payload)
            request_id, org_id = data.request_id, data.org_id
            result = recording.record_events([data], origin="retry", isolate=False)
        except recording.TRANSIENT:
            raise
        except Exception as exc:  # the rater or the data refused it again: keep the letter
            outcome, error = "failed", f"{type(exc).__name__}: {exc}"
        else:
            outcome = "recorded" if result.recorded else "duplicate"
    elif (row := _readable_row(letter.payload)) is not None:
        request_id, org_id = row[events.I_REQUEST], row[events.I_ORG]
    with transaction.atomic():
        letter = UsageDeadLetter.objects.select_for_update().get(pk=letter_id)
        before = {"error": letter.error, "resolved_at": _iso(letter.resolved_at)}
        if outcome == "failed":
            letter.error = error
            letter.save(update_fields=["error"])
        elif letter.resolved_at is None:  # recorded or duplicate (or resolved meanwhile)
            letter.resolved_at = timezone.now()
            letter.save(update_fields=["resolved_at"])
        audit_record(acting_user=acting_user, organization=org_id,
                     action="usage.dead_letter_retry", target=f"dead_letter:{letter_id}",
                     before=before, after={"outcome": outcome, "request_id": request_id,
                                           "origin": letter.origin, "error": error,
                                           "resolved_at": _iso(letter.resolved_at)})
    return DeadLetterRetry(letter_id, outcome, request_id, error)


def usage_dead_letters_retry(*, letter_ids: Iterable[int], acting_user: Any
                             ) -> list[DeadLetterRetry]:
    """Retry each of ``letter_ids`` in turn (``usage_dead_letter_retry``); unknown ids are
    skipped. One letter's failure does not stop the rest."""
    out = []
    for letter_id in letter_ids:
        try:
            out.append(usage_dead_letter_retry(letter_id=letter_id, acting_user=acting_user))
        except NotFound:
            continue
    return out


def _readable_row(payload: str) -> events.Row | None:
    try:
        return events.decode_row(payload)
    except InvalidRequest:
        return None


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment is not None else None


def connection_usable() -> bool:
    """Return whether PostgreSQL answers right now (used before replays)."""
    try:
        connection.ensure_connection()
        with connection.cursor() as cur:
            cur.execute("SELECT 1")
    except DatabaseError as exc:
        recording.close_broken_connection(exc)
        return False
    return True
