"""Record usage events in PostgreSQL exactly once, rated, with their hourly rollups.

This is the one write path behind every way in (the stream consumer, the gateway's fallback
when Redis is down, spool replay, the external API). Per batch, in one transaction:

1. claim the batch's idempotency keys in ``usage_event_id``: one ``COPY`` under a savepoint
   (the usual case, every key new), and where the primary key refuses one, one insert over
   arrays with ``ON CONFLICT DO NOTHING RETURNING``: what comes back is exactly the events not
   recorded before, even against concurrent writers (a conflicting insert waits for the other
   transaction, then fails or skips);
2. rate only those, in event-time order, through ``plans.rating.rate_usage_batch``: token plans
   keep state, so a redelivered duplicate must never reach the rater;
3. ``COPY`` the new events with their ratings straight into the partitioned ``usage_event``
   (PostgreSQL routes each row to its month);
4. upsert the hourly rollups with sums accumulated while the rows were formatted, in key order
   so concurrent writers lock rollup rows in the same order.

Either everything commits or nothing does, so a caller acknowledges its source (XACK, spool
file removal, HTTP 200) only after ``record_rows`` returns. An event that makes the batch fail
for a reason of its own (the rater refuses it, a value PostgreSQL rejects) is isolated by
bisecting the batch under savepoints and kept verbatim in ``usage_deadletter``; the rest is
recorded. Connection-level failures propagate: the caller retries or falls back. Events dated
before the usage retention horizon (``metering.retention``) are dead-lettered before any of
that, with the reason: their idempotency keys are no longer kept.

Rows are tuples in ``metering.events.ROW_FIELDS`` order with ``event_time`` as a UTC ISO
string, the shape the stream carries, so the consumer formats COPY lines without building
objects. Text values reach COPY unescaped only when they cannot hold a tab, newline or
backslash (validated events, or stream entries whose JSON had no escape at all); anything else
goes through psycopg's escaping.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from operator import itemgetter
from typing import TYPE_CHECKING, Any, TypeAlias

from django.db import (
    DatabaseError,
    InterfaceError,
    OperationalError,
    ProgrammingError,
    connection,
    transaction,
)
from psycopg.errors import UniqueViolation

from billing_platform.accounts.selectors import organization_data_zones
from metering import faults, metrics, partitions, retention
from metering.events import I_ORG, I_REQUEST, I_TIME, I_ZONE, Row, UsageEventData, row_wire, to_row

if TYPE_CHECKING:
    from psycopg import Cursor

    from plans.rating import Rating

log = logging.getLogger(__name__)

Key = tuple[int, str]
# A rollup's key, (org, project, key, model, region, tier, capacity, currency, hour), and its
# sums in ROLLUP_SUMS order: int counts, then Decimal amounts.
RollupKey: TypeAlias = tuple[Any, ...]
RollupSums: TypeAlias = list[Any]

# Keys go in in index order: neighbouring keys share leaf pages, and concurrent writers that
# meet on the same (duplicate) keys lock them in the same order.
CLAIM_KEYS = """
INSERT INTO usage_event_id (organization_id, request_id, event_time)
SELECT * FROM unnest(%s::bigint[], %s::text[], %s::text[]::timestamptz[])
    AS k (organization_id, request_id, event_time)
ORDER BY organization_id, request_id COLLATE "C"
ON CONFLICT DO NOTHING
RETURNING organization_id, request_id
"""
# The same for rows whose text holds no tab: three joined strings instead of three arrays
# (psycopg quotes array elements one by one; this is four times cheaper for a batch).
CLAIM_KEYS_JOINED = """
INSERT INTO usage_event_id (organization_id, request_id, event_time)
SELECT * FROM unnest(string_to_array(%s, ',')::bigint[], string_to_array(%s, E'\\t'),
                     string_to_array(%s, ',')::timestamptz[])
    AS k (organization_id, request_id, event_time)
ORDER BY organization_id, request_id COLLATE "C"
ON CONFLICT DO NOTHING
RETURNING organization_id, request_id
"""
COPY_KEYS = "COPY usage_event_id (organization_id, request_id, event_time) FROM STDIN"
EVENT_COLUMNS = (
    "request_id", "organization_id", "project_id", "api_key_id", "model", "region",
    "data_zone", "engine", "service_tier", "capacity_source", "prompt_tokens", "cached_tokens",
    "completion_tokens", "queue_ms", "ttft_ms", "total_ms", "status", "cost_to_serve",
    "event_time", "batch_id", "source", "amount", "currency", "price_version_id",
    "rating_breakdown", "credits_consumed", "normalized_tokens", "end_user", "reasoning_tokens",
)
COPY_EVENTS = f"COPY usage_event ({', '.join(EVENT_COLUMNS)}) FROM STDIN"

ROLLUP_KEY = ("organization_id", "project_id", "api_key_id", "model", "region", "service_tier",
              "capacity_source", "currency", "hour")
ROLLUP_SUMS = ("requests", "error_requests", "aborted_requests", "prompt_tokens",
               "cached_tokens", "completion_tokens", "normalized_tokens", "amount",
               "credits_consumed", "cost_to_serve", "input_amount", "cached_input_amount",
               "output_amount")
_ROLLUP_TYPES = ("bigint", "bigint", "bigint", "text", "text", "text", "text", "text",
                 "timestamptz", "bigint", "bigint", "bigint", "bigint", "bigint", "bigint",
                 "bigint", "numeric", "numeric", "numeric", "numeric", "numeric", "numeric")
# only our own column names are interpolated
UPSERT_ROLLUPS = f"""
INSERT INTO usage_rollup_hourly ({", ".join(ROLLUP_KEY + ROLLUP_SUMS)})
SELECT {", ".join(ROLLUP_KEY + ROLLUP_SUMS)}
FROM unnest({", ".join(f"%s::{t}[]" for t in _ROLLUP_TYPES)})
    WITH ORDINALITY AS u({", ".join(ROLLUP_KEY + ROLLUP_SUMS)}, ord)
ORDER BY ord
ON CONFLICT ON CONSTRAINT usage_rollup_hourly_key DO UPDATE SET
    {", ".join(f"{c} = usage_rollup_hourly.{c} + EXCLUDED.{c}" for c in ROLLUP_SUMS)}
"""  # noqa: S608
# The same for rollups whose text holds no tab: each column one tab-joined string (NULL as
# \N). psycopg dumps array parameters element by element in Python, which cost more per
# event than the rest of the upsert; joined, the 22 columns of a 5,000-event batch's ~1,200
# rollups go as 22 strings.
_JOINED_ARRAY = "string_to_array(%s, E'\\t', '\\N')::{}[]"
UPSERT_ROLLUPS_JOINED = UPSERT_ROLLUPS.replace(
    f"FROM unnest({', '.join(f'%s::{t}[]' for t in _ROLLUP_TYPES)})",
    f"FROM unnest({', '.join(_JOINED_ARRAY.format(t) for t in _ROLLUP_TYPES)})",
)

# Hours that received events over an hour after they ended (see ``UsageLateHour``).
LATE_AFTER = timedelta(hours=1)
MARK_LATE_HOURS = """
INSERT INTO usage_late_hour (organization_id, hour, recorded_at)
SELECT o, h, now() FROM unnest(%s::bigint[], %s::timestamptz[]) AS u(o, h) ORDER BY o, h
ON CONFLICT ON CONSTRAINT usage_late_hour_key DO UPDATE SET recorded_at = now()
"""

# Errors that say "this connection or this moment" (or "not built yet"), not "this event":
# never dead-letter on them.
TRANSIENT = (OperationalError, InterfaceError, ProgrammingError, NotImplementedError)
RETRY_SQLSTATES = frozenset({"40001", "40P01"})  # serialization failure, deadlock
_N = "\\N"
_KEY_ORDER = itemgetter(I_ORG, I_REQUEST)
_ZERO = Decimal(0)


@dataclass
class RecordResult:
    """What happened to each event of a batch, by idempotency key."""

    recorded: list[Key] = field(default_factory=list)
    duplicates: list[Key] = field(default_factory=list)
    dead_lettered: list[Key] = field(default_factory=list)
    # refused: they claimed another source's request id (see ``UsageIdConflict``)
    conflicts: list[Key] = field(default_factory=list)

    def merge(self, other: RecordResult) -> RecordResult:
        self.recorded += other.recorded
        self.duplicates += other.duplicates
        self.dead_lettered += other.dead_lettered
        self.conflicts += other.conflicts
        return self


def _fill_data_zones(rows: Sequence[Row]) -> list[Row]:
    missing = {r[I_ORG] for r in rows if not r[I_ZONE]}
    if not missing:
        return list(rows)
    zones = organization_data_zones(org_ids=missing)
    out = []
    for r in rows:
        if not r[I_ZONE]:
            if r[I_ORG] not in zones:
                raise LookupError(f"organization {r[I_ORG]} does not exist")
            r = (*r[:I_ZONE], zones[r[I_ORG]], *r[I_ZONE + 1:])
        out.append(r)
    return out


def _rate(rows: Sequence[Row]) -> list[Rating]:
    from plans.rating import UsageFacts, rate_usage_batch

    parse = datetime.fromisoformat
    facts = [
        UsageFacts(
            request_id=r[1], org_id=r[0], project_id=r[2], api_key_id=r[3], model=r[4],
            region=r[5], data_zone=r[6], service_tier=r[8], capacity_source=r[9],
            prompt_tokens=r[10], cached_tokens=r[11], completion_tokens=r[12],
            event_time=parse(r[18]),
        )
        for r in rows
    ]
    ratings = rate_usage_batch(facts)
    if len(ratings) != len(facts):
        raise RuntimeError(f"rate_usage_batch returned {len(ratings)} ratings "
                           f"for {len(facts)} events")
    return ratings


_BREAKDOWN_TEMPLATES: dict[tuple[str, ...], str] = {}


def _breakdown_json(breakdown: dict[str, Decimal]) -> str:
    """Return ``{"class": "amount", ...}``: one cached %-template per set of token classes."""
    classes = tuple(breakdown)
    template = _BREAKDOWN_TEMPLATES.get(classes)
    if template is None:
        # json.dumps escapes the class names; '%' is doubled so the template stays a template
        template = "{" + ",".join(f'{json.dumps(c).replace("%", "%%")}:"%s"'
                                  for c in classes) + "}"
        _BREAKDOWN_TEMPLATES[classes] = template
    return template % tuple(breakdown.values())


class _Rollups:
    """Hourly sums of the rows being recorded, keyed like ``usage_rollup_hourly``."""

    def __init__(self) -> None:
        self.sums: dict[RollupKey, RollupSums] = {}

    def add(self, r: Row, rating: Rating) -> None:
        when = r[I_TIME]
        key = (r[0], r[2], r[3], r[4], r[5], r[8], rating.capacity_source, rating.currency,
               when[:13])
        acc = self.sums.get(key)
        if acc is None:
            acc = self.sums[key] = [0, 0, 0, 0, 0, 0, 0, _ZERO, _ZERO, _ZERO, _ZERO, _ZERO,
                                    _ZERO]
        status = r[16]
        acc[0] += 1
        if status != "ok":
            acc[1 if status == "engine_error" else 2] += 1
        acc[3] += r[10]
        acc[4] += r[11]
        acc[5] += r[12]
        acc[6] += rating.normalized_tokens
        acc[7] += rating.amount
        acc[8] += rating.credits_consumed
        acc[9] += Decimal(r[17])
        lines = rating.breakdown
        acc[10] += lines.get("input", _ZERO)
        acc[11] += lines.get("cached_input", _ZERO)
        acc[12] += lines.get("output", _ZERO)

    def upsert(self, cur: Cursor[Any], *, trusted_text: bool) -> None:
        """Add the sums to ``usage_rollup_hourly``, in key order (see the module)."""
        keys = sorted(self.sums, key=lambda k: (k[0], k[1], k[2] or 0, *k[3:]))
        sums = self.sums
        columns = list(zip(*[(*key[:8], f"{key[8]}:00:00+00:00", *sums[key]) for key in keys],
                           strict=True))
        # one row: string_to_array('') is an empty array, not one empty string (a blank region)
        if not trusted_text or len(keys) == 1:
            cur.execute(UPSERT_ROLLUPS, [list(col) for col in columns])
            return
        cur.execute(UPSERT_ROLLUPS_JOINED, [
            "\t".join([_N if v is None else str(v) for v in col]) for col in columns])


def _write_events(cur: Cursor[Any], fresh: Sequence[Row], ratings: Sequence[Rating], *,
                  trusted_text: bool
                  ) -> _Rollups:
    rollups = _Rollups()
    add = rollups.add
    with cur.copy(COPY_EVENTS) as copy:
        if trusted_text:
            lines = []
            for r, g in zip(fresh, ratings, strict=True):
                add(r, g)
                k, q, t, tot, b, pv = r[3], r[13], r[14], r[15], r[19], g.price_version_id
                u = r[21]
                lines.append(
                    f"{r[1]}\t{r[0]}\t{r[2]}\t{_N if k is None else k}\t{r[4]}\t{r[5]}\t{r[6]}\t"
                    f"{r[7]}\t{r[8]}\t{g.capacity_source}\t{r[10]}\t{r[11]}\t{r[12]}\t"
                    f"{_N if q is None else q}\t{_N if t is None else t}\t"
                    f"{_N if tot is None else tot}\t{r[16]}\t{r[17]}\t{r[18]}\t"
                    f"{_N if b is None else b}\t{r[20]}\t{g.amount}\t{g.currency}\t"
                    f"{_N if pv is None else pv}\t{_breakdown_json(g.breakdown)}\t"
                    f"{g.credits_consumed}\t{g.normalized_tokens}\t{_N if u is None else u}\t"
                    f"{r[22]}\n"
                )
            copy.write("".join(lines))
        else:
            for r, g in zip(fresh, ratings, strict=True):
                add(r, g)
                copy.write_row((
                    r[1], r[0], r[2], r[3], r[4], r[5], r[6], r[7], r[8], g.capacity_source,
                    r[10], r[11], r[12], r[13], r[14], r[15], r[16], r[17], r[18], r[19], r[20],
                    g.amount, g.currency, g.price_version_id,
                    json.dumps({k: str(v) for k, v in g.breakdown.items()}),
                    g.credits_consumed, g.normalized_tokens, r[21], r[22],
                ))
    return rollups


def _copy_keys(cur: Cursor[Any], rows: Sequence[Row], *, trusted_text: bool) -> bool:
    """Claim every key of ``rows`` with one ``COPY``; return False, having claimed none, when
    some key was recorded before (or is being recorded by a concurrent transaction that then
    committed).

    Fresh keys are the usual case, and for them a plain COPY checked by the primary key costs
    about half of ``INSERT ... ON CONFLICT DO NOTHING RETURNING`` (a speculative insertion per
    row: a probe of the index, the insert, then its confirmation). A unique violation rolls
    back to the savepoint taken here, and the caller claims with ``_claim_keys``, which sorts
    the duplicates out. Keys go in in index order, as there.
    """
    # the primary key's order: organization, then the request id's bytes (COLLATE "C"),
    # which is the order of its code points, as Python compares strings
    keys = sorted(rows, key=_KEY_ORDER)
    cur.execute("SAVEPOINT tg_claim_keys")
    try:
        with cur.copy(COPY_KEYS) as copy:
            if trusted_text:
                copy.write("".join([f"{r[0]}\t{r[1]}\t{r[I_TIME]}\n" for r in keys]))
            else:
                for r in keys:
                    copy.write_row((r[0], r[1], r[I_TIME]))
    except UniqueViolation:
        cur.execute("ROLLBACK TO SAVEPOINT tg_claim_keys")
        return False
    cur.execute("RELEASE SAVEPOINT tg_claim_keys")
    return True


def _claim_keys(cur: Cursor[Any], rows: Sequence[Row], *, trusted_text: bool) -> bool:
    """Claim the keys of ``rows`` not recorded before; return whether all of them were."""
    if trusted_text:
        cur.execute(CLAIM_KEYS_JOINED, (",".join([str(r[0]) for r in rows]),
                                        "\t".join([r[1] for r in rows]),
                                        ",".join([r[I_TIME] for r in rows])))
    else:
        cur.execute(CLAIM_KEYS, ([r[0] for r in rows], [r[1] for r in rows],
                                 [r[I_TIME] for r in rows]))
    return cur.rowcount == len(rows)


def _record(rows: Sequence[Row], *, trusted_text: bool) -> RecordResult:
    """Record one batch inside the current transaction (the caller holds a savepoint)."""
    connection.ensure_connection()
    # psycopg's own cursor (for COPY); its errors are translated to Django's like any query's
    with connection.wrap_database_errors, connection.connection.cursor() as cur:
        rows = _fill_data_zones(rows)
        if (_copy_keys(cur, rows, trusted_text=trusted_text)
                or _claim_keys(cur, rows, trusted_text=trusted_text)):
            fresh = list(rows)
            result = RecordResult(recorded=[(r[0], r[1]) for r in rows])
        else:
            new_keys = set(cur.fetchall())
            fresh = [r for r in rows if (r[I_ORG], r[I_REQUEST]) in new_keys]
            result = RecordResult(
                recorded=[(r[0], r[1]) for r in fresh],
                duplicates=[(r[0], r[1]) for r in rows if (r[0], r[1]) not in new_keys],
            )
        if not fresh:
            return result
        fresh.sort(key=lambda r: r[I_TIME])  # uniform UTC ISO strings sort chronologically
        ratings = _rate(fresh)
        rollups = _write_events(cur, fresh, ratings, trusted_text=trusted_text)
        rollups.upsert(cur, trusted_text=trusted_text)
        metrics.usage_recorded_on_commit(rollups.sums)
        _mark_late_hours(cur, fresh)
        faults.point("before_commit")
    return result


def _mark_late_hours(cur: Cursor[Any], fresh: Sequence[Row]) -> None:
    """Record the hours of ``fresh`` (sorted by time) that ended over LATE_AFTER ago."""
    cutoff = (datetime.now(UTC) - LATE_AFTER).isoformat()
    if fresh[0][I_TIME][:13] >= cutoff[:13]:  # the usual case: nothing late
        return
    hours = sorted({(r[I_ORG], r[I_TIME][:13]) for r in fresh if r[I_TIME][:13] < cutoff[:13]})
    cur.execute(MARK_LATE_HOURS, ([o for o, _ in hours], [f"{h}:00:00+00:00" for _, h in hours]))


def _dead_letter(rows: Iterable[Row], error: BaseException, origin: str) -> None:
    from metering.models import UsageDeadLetter

    UsageDeadLetter.objects.bulk_create(
        UsageDeadLetter(payload=row_wire(r).decode(), error=f"{type(error).__name__}: {error}",
                        origin=origin)
        for r in rows
    )


def _refuse_beyond_horizon(rows: Sequence[Row], limit: datetime | None, origin: str
                           ) -> RecordResult:
    """Dead-letter rows dated before the retention horizon ``limit``, saying why."""
    if not rows or limit is None:
        return RecordResult()
    log.warning("%d usage event(s) dated before the retention horizon %s dead-lettered "
                "(origin %s), e.g. %s", len(rows), limit.date(), origin, rows[0][I_REQUEST])
    _dead_letter(rows, retention.UsageBeyondRetention(retention.beyond_message(limit)), origin)
    return RecordResult(dead_lettered=[(r[I_ORG], r[I_REQUEST]) for r in rows])


def _record_or_isolate(rows: Sequence[Row], origin: str, *, isolate: bool, trusted_text: bool
                       ) -> RecordResult:
    try:
        with transaction.atomic():
            return _record(rows, trusted_text=trusted_text)
    except TRANSIENT:
        raise
    except Exception as exc:
        if not isolate:
            raise
        if len(rows) == 1:
            log.warning("usage event %s dead-lettered: %s", rows[0][I_REQUEST], exc)
            _dead_letter(rows, exc, origin)
            return RecordResult(dead_lettered=[(rows[0][I_ORG], rows[0][I_REQUEST])])
        mid = len(rows) // 2
        kw = {"isolate": True, "trusted_text": trusted_text}
        return (_record_or_isolate(rows[:mid], origin, **kw)
                .merge(_record_or_isolate(rows[mid:], origin, **kw)))


def _iso(when: str | datetime) -> str:
    if isinstance(when, str):
        return when
    return when.astimezone(UTC).isoformat()


def _unique(rows: Iterable[Row]) -> tuple[list[Row], list[Key]]:
    """Return the first row of each idempotency key (event_time as UTC ISO), and repeats."""
    seen: dict[Key, Row] = {}
    again: list[Key] = []
    for r in rows:
        key = (r[I_ORG], r[I_REQUEST])
        if key in seen:
            again.append(key)
            continue
        if type(r[I_TIME]) is not str:
            r = (*r[:I_TIME], _iso(r[I_TIME]), *r[I_TIME + 1:])
        seen[key] = r
    return list(seen.values()), again


def _months(rows: Iterable[Row]) -> set[date]:
    return {date(int(m[:4]), int(m[5:7]), 1) for m in {r[I_TIME][:7] for r in rows}}


def record_rows(rows: Iterable[Row], *, origin: str, isolate: bool = True,
                trusted_text: bool = False, attempts: int = 3) -> RecordResult:
    """Record event rows (``metering.events.ROW_FIELDS`` order) exactly once; see the module.

    Safe to call again with the same rows: those already recorded come back as duplicates.
    With ``isolate`` a row that fails on its own is dead-lettered; without, the error is
    raised and nothing is recorded. ``trusted_text`` promises that no text value holds a tab,
    newline or backslash. Call it outside any transaction of the caller's, or the partition
    DDL and the batch share that transaction's fate.
    """
    unique, again = _unique(rows)
    unique, beyond, limit = retention.split_beyond_horizon(unique)
    if beyond and limit is not None and not isolate:
        raise retention.UsageBeyondRetention(retention.beyond_message(limit),
                                             param="event_time")
    if not unique and not beyond:
        return RecordResult(duplicates=again)
    if unique:
        partitions.ensure(_months(unique))
    for attempt in range(1, attempts + 1):
        try:
            with transaction.atomic():
                # in the batch's transaction: a retried batch does not dead-letter them twice
                result = _refuse_beyond_horizon(beyond, limit, origin)
                if unique:
                    result.merge(_record_or_isolate(unique, origin, isolate=isolate,
                                                    trusted_text=trusted_text))
            faults.point("after_commit")
            result.duplicates += again
            return result
        except OperationalError as exc:
            sqlstate = getattr(exc.__cause__, "sqlstate", None)
            if sqlstate not in RETRY_SQLSTATES or attempt == attempts:
                raise
            log.info("usage batch retried after %s (attempt %d)", sqlstate, attempt)
            time.sleep(0.05 * attempt)
    raise AssertionError("unreachable")


def record_events(events: Sequence[UsageEventData], *, origin: str, isolate: bool = True
                  ) -> RecordResult:
    """Record validated events exactly once (``record_rows`` for dataclasses)."""
    # normalize() refused tabs, newlines and backslashes in every text field
    return record_rows([to_row(e) for e in events], origin=origin, isolate=isolate,
                       trusted_text=True)


def close_broken_connection(exc: BaseException) -> None:
    """Drop Django's connection after a connection-level failure so the next call reconnects."""
    if isinstance(exc, DatabaseError | OSError) and not connection.in_atomic_block:
        try:
            connection.close()
        except DatabaseError:
            log.debug("closing a broken connection failed", exc_info=True)
