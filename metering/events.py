"""The one shape of a usage event on its way in, and its wire encoding.

Every path (the gateway's append, the Redis stream, the spool file, the direct PostgreSQL
write, the external API) carries a ``UsageEventData``; on the stream and in the spool it is one
compact JSON object, so the consumer parses one value per entry instead of dozens of fields.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import Any, TypeAlias

import orjson

from billing_platform.errors import InvalidRequest
from metering.choices import CapacitySource, EventSource, EventStatus, ServiceTier

TIERS = frozenset(ServiceTier.values)
SOURCES = frozenset(CapacitySource.values)
STATUSES = frozenset(EventStatus.values)
ORIGINS = frozenset(EventSource.values)
MAX_ID = 128  # an id as its issuer wrote it (a platform request id, a caller's event id)
# Each source has its own id space. The platform issues its ids itself (gateway requests,
# batch lines): "req_", the issue time and 80 bits from the OS's CSPRNG, so nobody can guess
# one before it is used (ids issued before time-ordering, all 128 bits random, keep the form).
# Ids reported through the usage API are the caller's own and are stored under EXTERNAL_PREFIX,
# so no external event can ever take the key of a platform event, however it spells its id
# (see ``normalize``).
EXTERNAL_PREFIX = "ext:"
MAX_KEY = MAX_ID + len(EXTERNAL_PREFIX)  # a stored request id
PLATFORM_ID = re.compile(r"req_[0-9a-f]{32}")
MAX_USER = 256  # a client's end-user id (OpenAI's ``user``), as the client wrote it
# Characters no text field of an event may hold (COPY's text format would need them escaped).
FORBIDDEN = "\t\n\r\\\x00"
MAX_TOKENS = 2**53  # far beyond any context window; keeps sums inside bigint
MAX_MS = 2**31 - 1
# Events are accepted back to this far in the past (batch imports, late spool replays) and
# this far ahead (clock skew between an engine host and us).
MAX_AGE = timedelta(days=400)
MAX_SKEW = timedelta(days=1)


@dataclass(frozen=True, slots=True)
class UsageEventData:
    """A usage event before rating. Tokens are the engine's counts; timings are ms."""

    request_id: str
    org_id: int
    project_id: int
    model: str
    region: str  # the engine's region; "" when no engine was reached
    event_time: datetime  # aware; stored in UTC
    api_key_id: int | None = None
    data_zone: str = ""  # the org's zone; filled from the org when empty
    engine: str = ""
    service_tier: str = ServiceTier.DEFAULT
    capacity_source: str = CapacitySource.ON_DEMAND
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    queue_ms: int | None = None
    ttft_ms: int | None = None
    total_ms: int | None = None
    status: str = EventStatus.OK
    cost_to_serve: Decimal = Decimal("0")
    batch_id: str | None = None
    source: str = EventSource.GATEWAY
    end_user: str | None = None  # the request's ``user``; None when it named none
    # of ``completion_tokens``, those the engine's reasoning parser counted as thinking
    # (priced as output, like the rest of the completion)
    reasoning_tokens: int = 0

    @property
    def key(self) -> tuple[int, str]:
        """Return the idempotency key: (organization id, request id in its source's space)."""
        return (self.org_id, self.request_id)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def new_request_id() -> str:
    """Return a fresh, unguessable platform request id: ``req_``, the issue time (12 hex digits
    of ms since the epoch) and 80 random bits (20 hex digits) from the OS's CSPRNG.

    The time first makes ids issued later sort later, so each organization's new idempotency
    keys land at the right edge of ``usage_event_id``'s primary key (a few hot pages per
    batch) instead of on random leaf pages across the whole index, which cost the ingest
    consumer a page read and write per event once the index outgrew memory. 80 random bits
    still leave nothing to guess.
    """
    return f"req_{_now_ms():012x}{secrets.token_hex(10)}"


def external_request_id(event_id: str) -> str:
    """Return the stored request id of an event id reported through the usage API."""
    return EXTERNAL_PREFIX + event_id


def caller_event_id(request_id: str) -> str:
    """Return a stored request id as its issuer wrote it (an external event's own id)."""
    return request_id.removeprefix(EXTERNAL_PREFIX)


def looks_like_platform_id(event_id: str) -> bool:
    """Return whether an id has the form of one the platform issues itself."""
    return PLATFORM_ID.fullmatch(event_id) is not None


FIELDS = tuple(f.name for f in dataclasses.fields(UsageEventData))
_REQUIRED = ("request_id", "org_id", "project_id", "model", "event_time")


def _int(value: Any, name: str, *, upper: int = MAX_TOKENS, null: bool = False) -> int | None:
    if value is None and null:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, float) and name.endswith("_ms"):
        value = round(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= upper:
        raise InvalidRequest(f"{name} must be an integer between 0 and {upper}.", param=name)
    return value


def _text(value: Any, name: str, *, max_length: int = 200, blank: bool = False) -> str:
    if not isinstance(value, str) or (not value and not blank) or len(value) > max_length:
        raise InvalidRequest(
            f"{name} must be a {'' if blank else 'non-empty '}string of at most "
            f"{max_length} characters.", param=name,
        )
    if any(ch in value for ch in FORBIDDEN):
        raise InvalidRequest(f"{name} must not contain control characters or '\\'.", param=name)
    return value


def is_end_user(value: Any) -> bool:
    """Return whether ``value`` can be an event's end user (a client's ``user``): a string of
    at most ``MAX_USER`` characters without the characters ``_text`` refuses."""
    return (isinstance(value, str) and len(value) <= MAX_USER
            and not any(ch in value for ch in FORBIDDEN))


def _time(value: Any, now: datetime | None) -> datetime:
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise InvalidRequest("event_time must be an ISO 8601 timestamp.",
                                 param="event_time") from None
    if isinstance(value, int | float) and not isinstance(value, bool):
        value = datetime.fromtimestamp(value, UTC)
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise InvalidRequest("event_time must be a timezone-aware timestamp.", param="event_time")
    at: datetime = value.astimezone(UTC)
    if now is not None and not now - MAX_AGE <= at <= now + MAX_SKEW:
        raise InvalidRequest(
            f"event_time must be within the last {MAX_AGE.days} days and at most "
            f"{MAX_SKEW.days} day ahead.", param="event_time",
        )
    return at


def normalize(event: UsageEventData | Mapping[str, Any], *, check_age: bool = True
              ) -> UsageEventData:
    """Return the validated, canonical form of an event (a dict or a dataclass).

    Raise ``InvalidRequest`` naming the offending field. ``check_age`` bounds ``event_time``
    to the accepted window; replays of already-accepted events skip it.
    """
    if dataclasses.is_dataclass(event) and not isinstance(event, type):
        event = {name: getattr(event, name) for name in FIELDS if hasattr(event, name)}
    if not isinstance(event, Mapping):
        raise InvalidRequest("A usage event must be an object.")
    unknown = set(event) - set(FIELDS)
    if unknown:
        raise InvalidRequest(f"Unknown field(s): {', '.join(sorted(unknown))}.",
                             param=sorted(unknown)[0])
    missing = [name for name in _REQUIRED if event.get(name) in (None, "")]
    if missing:
        raise InvalidRequest(f"Missing required field(s): {', '.join(missing)}.",
                             param=missing[0])
    get = event.get
    tier = get("service_tier", ServiceTier.DEFAULT)
    source = get("capacity_source", CapacitySource.ON_DEMAND)
    status = get("status", EventStatus.OK)
    origin = get("source", EventSource.GATEWAY)
    for name, value, allowed in (("service_tier", tier, TIERS),
                                 ("capacity_source", source, SOURCES),
                                 ("status", status, STATUSES), ("source", origin, ORIGINS)):
        if value not in allowed:
            raise InvalidRequest(f"{name} must be one of {', '.join(sorted(allowed))}.",
                                 param=name)
    prompt = _int(get("prompt_tokens", 0), "prompt_tokens")
    cached = _int(get("cached_tokens", 0), "cached_tokens")
    if cached > prompt:  # type: ignore[operator]
        raise InvalidRequest("cached_tokens cannot exceed prompt_tokens.", param="cached_tokens")
    try:
        cost = Decimal(str(get("cost_to_serve") or "0"))
    except InvalidOperation:
        raise InvalidRequest("cost_to_serve must be a decimal number.",
                             param="cost_to_serve") from None
    if not cost.is_finite() or cost < 0 or cost >= Decimal("1e17"):
        raise InvalidRequest("cost_to_serve must be a non-negative number.",
                             param="cost_to_serve")
    completion = _int(get("completion_tokens", 0), "completion_tokens")
    reasoning = _int(get("reasoning_tokens") or 0, "reasoning_tokens")
    if reasoning > completion:  # type: ignore[operator]
        raise InvalidRequest("reasoning_tokens cannot exceed completion_tokens (they are part "
                             "of them).", param="reasoning_tokens")
    api_key_id = get("api_key_id")
    batch_id = get("batch_id")
    end_user = get("end_user")
    external = origin == EventSource.EXTERNAL
    request_id = _text(get("request_id"), "request_id",
                       max_length=MAX_KEY if external else MAX_ID)
    # The id spaces of the sources never meet: an external event's id is in the external
    # namespace, and no other event's is.
    if external != (request_id.startswith(EXTERNAL_PREFIX)
                    and len(request_id) > len(EXTERNAL_PREFIX)):
        raise InvalidRequest(
            f"request_id: ids of external events, and only theirs, start with "
            f"{EXTERNAL_PREFIX!r} (metering.events.external_request_id).", param="request_id")
    return UsageEventData(
        request_id=request_id,
        org_id=_int(get("org_id"), "org_id", upper=2**63 - 1),  # type: ignore[arg-type]
        project_id=_int(get("project_id"), "project_id", upper=2**63 - 1),  # type: ignore[arg-type]
        api_key_id=_int(api_key_id, "api_key_id", upper=2**63 - 1, null=True),
        model=_text(get("model"), "model"),
        # empty when the request failed before an engine was chosen
        region=_text(get("region") or "", "region", max_length=64, blank=True),
        data_zone=_text(get("data_zone") or "", "data_zone", max_length=16, blank=True),
        engine=_text(get("engine") or "", "engine", blank=True),
        service_tier=tier,
        capacity_source=source,
        prompt_tokens=prompt,  # type: ignore[arg-type]
        cached_tokens=cached,  # type: ignore[arg-type]
        completion_tokens=completion,  # type: ignore[arg-type]
        queue_ms=_int(get("queue_ms"), "queue_ms", upper=MAX_MS, null=True),
        ttft_ms=_int(get("ttft_ms"), "ttft_ms", upper=MAX_MS, null=True),
        total_ms=_int(get("total_ms"), "total_ms", upper=MAX_MS, null=True),
        status=status,
        cost_to_serve=cost,
        event_time=_time(get("event_time"), datetime.now(UTC) if check_age else None),
        batch_id=None if batch_id is None else _text(batch_id, "batch_id", max_length=MAX_ID),
        source=origin,
        end_user=None if end_user in (None, "") else _text(end_user, "end_user",
                                                           max_length=MAX_USER),
        reasoning_tokens=reasoning,  # type: ignore[arg-type]
    )


# The wire form is a JSON array, version first, then the columns in ``ROW_FIELDS`` order:
# positional, so the consumer parses about a third of the bytes of an object and hands the
# values to COPY as they are (timestamps and decimals stay strings; PostgreSQL parses them).
# Fields added since come last, in ``ADDED_FIELDS`` order: an entry written before one of them
# (still on the stream or in a spool file, that many values shorter) reads as having its
# default; the version stays 1, so readers that match on the frame's prefix (dead letters by
# organization) see all alike.
WIRE_VERSION = 1
ADDED_FIELDS = (("end_user", None), ("reasoning_tokens", 0))
ROW_FIELDS = (
    "org_id", "request_id", "project_id", "api_key_id", "model", "region", "data_zone",
    "engine", "service_tier", "capacity_source", "prompt_tokens", "cached_tokens",
    "completion_tokens", "queue_ms", "ttft_ms", "total_ms", "status", "cost_to_serve",
    "event_time", "batch_id", "source", *(name for name, _ in ADDED_FIELDS),
)
ROW_LEN = len(ROW_FIELDS)
_OLDEST_LEN = 1 + ROW_LEN - len(ADDED_FIELDS)  # an entry's values, version included
I_END_USER = ROW_FIELDS.index("end_user")
I_REASONING = ROW_FIELDS.index("reasoning_tokens")
I_ORG, I_REQUEST, I_ZONE, I_COST, I_TIME = (ROW_FIELDS.index(n) for n in (
    "org_id", "request_id", "data_zone", "cost_to_serve", "event_time"))

# one event in ROW_FIELDS order; event_time/cost_to_serve as values or strings
Row: TypeAlias = tuple[Any, ...]


def pad_entry(values: object) -> None:
    """Give a decoded entry written before the last ``ADDED_FIELDS`` their defaults, in place
    (anything that is not such a list is left as it is)."""
    if type(values) is list and _OLDEST_LEN <= len(values) <= ROW_LEN:
        values.extend(default for _, default in ADDED_FIELDS[len(values) - _OLDEST_LEN:])


def to_row(event: UsageEventData) -> Row:
    """Return the event as a row in ``ROW_FIELDS`` order."""
    return tuple(getattr(event, name) for name in ROW_FIELDS)


def row_wire(row: Row) -> bytes:
    """Return a row in its wire form (one line of compact JSON, no newline)."""
    values = list(row)
    if not isinstance(values[I_TIME], str):
        values[I_TIME] = values[I_TIME].astimezone(UTC).isoformat()
    values[I_COST] = str(values[I_COST])
    return orjson.dumps([WIRE_VERSION, *values])


def encode(event: UsageEventData) -> bytes:
    """Return the event in its wire form."""
    return row_wire(to_row(event))


def decode_row(raw: bytes | str) -> Row:
    """Return the row of an entry written by ``encode``, checking only its frame.

    This is the consumer's hot path: the values were validated by ``normalize`` before they
    were appended, and a value PostgreSQL rejects is isolated by the record path anyway.
    Raise ``InvalidRequest`` when the bytes are not a version-1 event.
    """
    try:
        values = orjson.loads(raw)  # the consumer's hot path: a third of json.loads' time
    except ValueError as exc:  # orjson.JSONDecodeError is one
        raise InvalidRequest(f"Unreadable usage event: {exc}") from None
    pad_entry(values)
    if type(values) is not list or len(values) != ROW_LEN + 1 or values[0] != WIRE_VERSION:
        raise InvalidRequest("Not a version-1 usage event.")
    row = tuple(values[1:])
    when = row[I_TIME]
    if type(row[I_ORG]) is not int or type(row[I_REQUEST]) is not str or type(when) is not str \
            or not when.endswith("+00:00"):
        raise InvalidRequest("Malformed usage event.")
    return row


def decode(raw: bytes | str) -> UsageEventData:
    """Return the event encoded by ``encode``, fully validated again.

    Raise ``InvalidRequest`` when the bytes are not a valid event.
    """
    row = decode_row(raw)
    return normalize(dict(zip(ROW_FIELDS, row, strict=True)), check_age=False)
