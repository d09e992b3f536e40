"""Usage API (/api/v1/usage): external event ingest and usage read-out. Views stay thin.

Who may do what:

- ``POST /api/v1/usage/events`` writes billable usage, so it takes what may change the bill: an
  API key with the ``admin`` scope (its own organization; events default to the key's
  project), or a signed-in owner or admin of the organization (``org.write``). An
  ``inference`` key may not report usage: it would let any developer key bill (or un-bill) its
  organization.
- ``GET /api/v1/usage`` reads usage: any member of the organization (``read``); an ``admin``
  key sees its whole organization; a ``usage:read`` key sees its own project only.

The organization comes from the key, or for a session from ``organization`` (optional when
the user belongs to exactly one).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any, cast

from django.db import DatabaseError
from django.db.models import QuerySet
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import exceptions
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from billing_platform.accounts.choices import Scope
from billing_platform.accounts.models import ApiKey, Organization, Project, User
from billing_platform.accounts.selectors import org_access, organizations_for_user
from billing_platform.db import replica_report
from billing_platform.errors import Forbidden, InvalidRequest, NotFound
from metering import conf, events, retention, services
from metering import serializers as s
from metering.choices import EventSource, EventStatus
from metering.recording import TRANSIENT, close_broken_connection
from metering.retention import UsageBeyondRetention
from metering.selectors import (
    EVENT_GROUPS,
    GROUPS,
    SUMS,
    UsageBucket,
    UsageFilter,
    usage_summary,
)


@dataclass(frozen=True)
class UsageCaller:
    """The organization a usage request acts on, and how far the caller may see into it."""

    organization: Organization
    default_project_id: int | None  # the calling key's project
    only_project_id: int | None  # set for usage:read keys


def _caller(request: Request, org_param: str | None, *, write: bool) -> UsageCaller:
    principal = getattr(request.user, "principal", None)
    if principal is not None:
        if org_param and org_param != principal.org_public_id:
            raise NotFound("No such organization.")
        if write or principal.has_scope(Scope.ADMIN):
            access = org_access(user=None, principal=principal,
                                org_public_id=principal.org_public_id)
            return UsageCaller(access.organization, principal.project_id, None)
        if not principal.has_scope(Scope.USAGE_READ):
            raise Forbidden("This API key lacks the 'usage:read' scope.")
        org = Organization.objects.get(pk=principal.org_id)
        return UsageCaller(org, principal.project_id, principal.project_id)
    if not org_param:
        # IsAuthenticated (the default permission) let only a signed-in user here
        orgs = list(organizations_for_user(user=cast(User, request.user))[:2])
        if len(orgs) != 1:
            raise InvalidRequest("organization is required: you belong to several "
                                 "organizations (or none).", param="organization")
        org_param = orgs[0].public_id
    access = org_access(user=request.user, principal=None, org_public_id=org_param)
    needed = "org.write" if write else "read"
    if not access.can(needed):
        raise exceptions.PermissionDenied(
            f"Your role ({access.role}) does not allow this ({needed}).")
    return UsageCaller(access.organization, None, None)


def _field_errors(exc: exceptions.ValidationError | InvalidRequest) -> dict[str, Any]:
    if isinstance(exc, InvalidRequest):
        return {exc.param or "non_field_errors": [exc.message]}
    detail = exc.detail
    if isinstance(detail, dict):
        return {k: [str(m) for m in (v if isinstance(v, list) else [v])]
                for k, v in detail.items()}
    return {"non_field_errors": [str(m) for m in detail]}


class UsageEventIngestApi(APIView):
    """Record usage reported by engines outside the fleet (bulk, idempotent by event id)."""

    @extend_schema(
        operation_id="usage_events_ingest", tags=["usage"],
        request=s.UsageEventBatchDocSerializer,
        responses={200: s.UsageEventBatchResultSerializer},
        description="Up to 10,000 events per call. Each event is validated on its own: invalid "
                    "ones come back in `errors` with their index, the valid ones are recorded. "
                    "An event whose id was recorded before is reported as `duplicate` and "
                    "changes nothing, so a retried call is safe. Your ids are your own: they "
                    "never meet the platform's request ids (`req_...` of /v1 requests and "
                    "batch lines); an event that reports one is refused (`id_conflict`) and "
                    "the attempt is kept for review. Events are rated at their `event_time`. "
                    "With usage retention on (`TOLLGATE_USAGE_RETENTION_MONTHS`), an event dated "
                    "before the retention horizon is refused (`beyond_retention`, naming the "
                    "horizon): its id could no longer be checked, so it could be billed twice.",
    )
    def post(self, request: Request) -> Response:
        body = s.UsageEventBatchSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        caller = _caller(request, body.validated_data.get("organization"), write=True)
        org = caller.organization
        raw_events = body.validated_data["events"]

        child = s.ExternalUsageEventSerializer()
        parsed: list[tuple[int, dict[str, Any]]] = []
        errors: list[dict[str, Any]] = []
        for index, item in enumerate(raw_events):
            try:
                parsed.append((index, child.run_validation(item)))
            except exceptions.ValidationError as exc:
                errors.append({"index": index, "id": _id_of(item), "code": "invalid",
                               "errors": _field_errors(exc)})

        projects = dict(Project.objects.filter(
            organization=org, public_id__in={e["project"] for _, e in parsed if "project" in e},
        ).values_list("public_id", "id"))
        keys = {k.public_id: k for k in ApiKey.objects.filter(
            organization=org, public_id__in={e["api_key"] for _, e in parsed if e["api_key"]},
        )}
        now = timezone.now()
        valid: list[tuple[int, events.UsageEventData]] = []
        for index, e in parsed:
            try:
                valid.append((index, _to_event(e, org=org, caller=caller, projects=projects,
                                               keys=keys, now=now)))
            except InvalidRequest as exc:
                code = exc.code if isinstance(exc, UsageBeyondRetention) else "invalid"
                errors.append({"index": index, "id": e["id"], "code": code,
                               "errors": _field_errors(exc)})

        try:
            result = services.usage_events_record_external(
                [ev for _, ev in valid], reported_by=_reporter(request))
        except TRANSIENT as exc:
            if isinstance(exc, DatabaseError):
                close_broken_connection(exc)
            raise services.UsageNotRecorded(
                "Usage could not be recorded right now; retry the same call.") from exc
        recorded = set(result.recorded)
        dead = set(result.dead_lettered)
        conflicts = set(result.conflicts)
        data = []
        for index, ev in valid:
            own_id = events.caller_event_id(ev.request_id)
            if ev.key in conflicts:
                errors.append({"index": index, "id": own_id, "code": "id_conflict",
                               "errors": {"id": [
                                   "This is a request id of the platform's own (an event it "
                                   "meters itself), not an id of yours; the event was not "
                                   "recorded and the attempt was logged."]}})
                continue
            if ev.key in dead:
                errors.append({"index": index, "id": own_id, "code": "not_rated",
                               "errors": {"non_field_errors": [
                                   "The event could not be rated (is the model priced?); it "
                                   "is kept for review and can be sent again."]}})
                continue
            status = "recorded" if ev.key in recorded else "duplicate"
            recorded.discard(ev.key)  # a repeated id inside one call is a duplicate
            data.append({"index": index, "id": own_id, "status": status})
        errors.sort(key=lambda err: err["index"])
        out = {
            "object": "usage.ingest_result",
            "recorded": sum(1 for d in data if d["status"] == "recorded"),
            "duplicates": sum(1 for d in data if d["status"] == "duplicate"),
            "rejected": len(errors), "data": data, "errors": errors,
        }
        return Response(s.UsageEventBatchResultSerializer(out).data)


def _reporter(request: Request) -> str:
    principal = getattr(request.user, "principal", None)
    return principal.key_public_id if principal is not None else str(request.user)


def _id_of(item: Any) -> str | None:
    value = item.get("id") if isinstance(item, dict) else None
    return value if isinstance(value, str) else None


def _to_event(e: dict[str, Any], *, org: Organization, caller: UsageCaller,
              projects: dict[str, int], keys: dict[str, ApiKey], now: datetime
              ) -> events.UsageEventData:
    key = None
    if e["api_key"]:
        key = keys.get(e["api_key"])
        if key is None:
            raise InvalidRequest("No such API key in this organization.", param="api_key")
    if "project" in e:
        project_id = projects.get(e["project"])
        if project_id is None:
            raise InvalidRequest("No such project in this organization.", param="project")
        if key is not None and key.project_id != project_id:
            raise InvalidRequest("The API key belongs to another project.", param="api_key")
    elif key is not None:
        project_id = key.project_id
    elif caller.default_project_id is not None:
        project_id = caller.default_project_id
    else:
        raise InvalidRequest("project is required.", param="project")
    event_time = e.get("event_time") or now
    retention.refuse_beyond_horizon(event_time, now=now)
    if event_time < org.created_at:
        # before the organization's first billing period: it would be rated and never invoiced
        raise InvalidRequest("event_time is before the organization was created "
                             f"({org.created_at.isoformat()}).", param="event_time")
    return events.normalize(events.UsageEventData(
        request_id=events.external_request_id(e["id"]), org_id=org.id, project_id=project_id,
        api_key_id=key.id if key else None, model=e["model"], region=e["region"],
        data_zone=org.data_zone, engine=e["engine"], service_tier=e["service_tier"],
        capacity_source=e["capacity_source"], prompt_tokens=e["prompt_tokens"],
        cached_tokens=e["cached_tokens"], completion_tokens=e["completion_tokens"],
        reasoning_tokens=e["reasoning_tokens"], queue_ms=e["queue_ms"], ttft_ms=e["ttft_ms"],
        total_ms=e["total_ms"],
        status=e["status"], event_time=event_time, batch_id=e["batch_id"],
        source=EventSource.EXTERNAL,
    ))


def _parse_bound(value: str, param: str) -> datetime:
    try:
        if len(value) == 10:
            return datetime.combine(date.fromisoformat(value), datetime.min.time(), UTC)
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidRequest(f"{param} must be a date or an ISO 8601 timestamp.",
                             param=param) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    moment = moment.astimezone(UTC)
    if moment.minute or moment.second or moment.microsecond:
        raise InvalidRequest(f"{param} must be on the hour: usage is summed per hour.",
                             param=param)
    return moment


def _csv(value: str | None) -> tuple[str, ...]:
    return tuple(v.strip() for v in (value or "").split(",") if v.strip())


def _filter_values(params: Mapping[str, Any], name: str) -> tuple[str, ...]:
    """Return a comma-separated filter's values; refuse more than one request may list."""
    values = tuple(dict.fromkeys(_csv(params.get(name))))
    most = conf.usage_api_max_filter_values()
    if len(values) > most:
        raise InvalidRequest(f"{name} lists {len(values)} values; one request may filter by at "
                             f"most {most}. Split it into several requests.", param=name,
                             code="too_many_values")
    return values


def _refuse_unbounded(start: datetime, end: datetime, group_by: tuple[str, ...],
                      by_status: bool = False) -> None:
    """Refuse a usage read longer than the range bound, or whose time buckets alone would be
    more groups than one answer holds (checked before any query runs)."""
    span = end - start
    max_days = conf.usage_api_max_range_days()
    if span > timedelta(days=max_days):
        raise InvalidRequest(
            f"The range from start to end is {span.total_seconds() / 86400:g} days; one request "
            f"may sum at most {max_days} days. Split the range into several requests.",
            param="end", code="usage_range_too_large")
    by_events = [f"grouping by {g}" for g in group_by if g in EVENT_GROUPS]
    by_events += ["filtering by status"] if by_status else []
    max_event_days = conf.usage_api_max_event_range_days()
    if by_events and span > timedelta(days=max_event_days):
        raise InvalidRequest(
            f"{by_events[0].capitalize()} sums the recorded events themselves; one request may "
            f"sum at most {max_event_days} days of them. Split the range into several "
            "requests.", param="end", code="usage_range_too_large")
    max_groups = conf.usage_api_max_groups()
    for unit, size in (("hour", timedelta(hours=1)), ("day", timedelta(days=1))):
        buckets = -(-span // size)  # a partial day is a bucket of its own
        if unit in group_by and buckets > max_groups:
            raise InvalidRequest(
                f"Grouping by {unit} over this range makes {buckets} groups; one answer holds at "
                f"most {max_groups}. Shorten the range or group by day.", param="group_by",
                code="usage_too_many_groups")


def _bucket_json(bucket: UsageBucket) -> dict[str, Any]:
    out: dict[str, Any] = dict(bucket.group)
    out["currency"] = bucket.currency
    for name in SUMS:
        out[name] = getattr(bucket, name)
    out["total_tokens"] = bucket.total_tokens
    return out


def usage_totals(buckets: list[UsageBucket]) -> list[UsageBucket]:
    """Return the sums of buckets per currency (amounts of two currencies are never added)."""
    per_currency: dict[str, UsageBucket] = {}
    for b in buckets:
        t = per_currency.setdefault(b.currency, UsageBucket(group={}, currency=b.currency))
        for name in SUMS:
            setattr(t, name, getattr(t, name) + getattr(b, name))
    return [per_currency[c] for c in sorted(per_currency)]


class UsageApi(APIView):
    """Usage of an organization summed from the hourly rollups."""

    @extend_schema(
        operation_id="usage_summary", tags=["usage"],
        parameters=[
            OpenApiParameter("organization", str, description="Organization id (sessions)."),
            OpenApiParameter("start", str, description="Inclusive date or on-the-hour time "
                             "(UTC). Default: the start of the current month."),
            OpenApiParameter("end", str, description="Exclusive, like start. Default: the end "
                             "of the current hour."),
            OpenApiParameter("project", str, description="Comma-separated project ids."),
            OpenApiParameter("key", str, description="Comma-separated API key ids."),
            OpenApiParameter("model", str, description="Comma-separated model names."),
            OpenApiParameter("service_tier", str, description="Comma-separated tiers."),
            OpenApiParameter("region", str, description="Comma-separated regions."),
            OpenApiParameter("status", str, description="Comma-separated outcomes: ok, "
                             "engine_error, client_aborted (at most 31 days: read from the "
                             "events)."),
            OpenApiParameter("group_by", str, description="Comma-separated: "
                             + ", ".join(GROUPS)),
        ],
        responses={200: s.UsageSummarySerializer},
        description="Token and amount sums over whole UTC hours, equal to the sums of the "
                    "recorded events. Amounts are per currency, in the price book's currency. "
                    "One request sums at most `TOLLGATE_USAGE_MAX_RANGE_DAYS` days (366 by "
                    "default; `usage_range_too_large`), answers at most "
                    "`TOLLGATE_USAGE_MAX_GROUPS` groups (10,000; `usage_too_many_groups`), sums "
                    "at most `TOLLGATE_USAGE_MAX_EVENT_RANGE_DAYS` days (31) when grouped by "
                    "`user` or filtered by `status` (read from the events: the rollups do not keep "
                    "them) and "
                    "takes at most `TOLLGATE_USAGE_MAX_FILTER_VALUES` values per filter (100; "
                    "`too_many_values`); beyond a bound it answers 400 saying which.",
    )
    @replica_report  # may lag the primary by DATABASE_REPLICA_MAX_LAG_S (billing_platform/db.py)
    def get(self, request: Request) -> Response:
        q = s.UsageQuerySerializer(data=request.query_params)
        q.is_valid(raise_exception=True)
        params = q.validated_data
        caller = _caller(request, params.get("organization"), write=False)
        org = caller.organization
        query = usage_query(params, organization=org, only_project_id=caller.only_project_id,
                            now=timezone.now())
        buckets = usage_buckets(query)
        out = {
            "object": "usage", "organization": org.public_id, "start": query.start,
            "end": query.end, "group_by": list(query.group_by),
            "data": [_bucket_json(b) for b in buckets],
            "totals": [_bucket_json(t) for t in usage_totals(buckets)],
        }
        return Response(s.UsageSummarySerializer(out).data)


@dataclass(frozen=True)
class UsageQuery:
    """A usage read, validated and bounded: what to sum and how to group it."""

    usage_filter: UsageFilter
    group_by: tuple[str, ...]

    @property
    def start(self) -> datetime:
        return self.usage_filter.start

    @property
    def end(self) -> datetime:
        return self.usage_filter.end


def usage_query(params: Mapping[str, Any], *, organization: Organization,
                only_project_id: int | None, now: datetime) -> UsageQuery:
    """Return the usage read that ``GET /api/v1/usage``'s parameters ask of an organization.

    ``params`` are ``UsageQuerySerializer``'s validated data. The console's usage explorer
    reads through here too, so its ranges, filters, bounds and messages are the API's. Raises
    ``InvalidRequest`` (naming the parameter) for a malformed or unbounded read, or an id that
    is not the organization's; ``NotFound`` for a project a project-bound key may not read.
    """
    start = (_parse_bound(params["start"], "start") if params.get("start")
             else now.replace(day=1, hour=0, minute=0, second=0, microsecond=0))
    end = (_parse_bound(params["end"], "end") if params.get("end")
           else now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1))
    if end <= start:
        raise InvalidRequest("end must be after start.", param="end")
    group_by = tuple(dict.fromkeys(_csv(params.get("group_by"))))
    unknown = [g for g in group_by if g not in GROUPS]
    if unknown:
        raise InvalidRequest(f"Cannot group by {', '.join(unknown)}; choose from "
                             f"{', '.join(GROUPS)}.", param="group_by")
    statuses = _filter_values(params, "status")
    unknown = [v for v in statuses if v not in EventStatus.values]
    if unknown:
        raise InvalidRequest(f"Unknown status {unknown[0]!r}; choose from "
                             f"{', '.join(EventStatus.values)}.", param="status")
    _refuse_unbounded(start, end, group_by, by_status=bool(statuses))

    project_ids = _lookup(Project, organization, _filter_values(params, "project"), "project")
    if only_project_id is not None:
        if project_ids and set(project_ids) != {only_project_id}:
            raise NotFound("No such project.")
        project_ids = (only_project_id,)
    key_ids = _lookup(ApiKey, organization, _filter_values(params, "key"), "key",
                      project_id=only_project_id)
    return UsageQuery(
        usage_filter=UsageFilter(
            org_id=organization.id, start=start, end=end, project_ids=project_ids,
            api_key_ids=key_ids, models=_filter_values(params, "model"),
            service_tiers=_filter_values(params, "service_tier"),
            regions=_filter_values(params, "region"), statuses=statuses,
        ),
        group_by=group_by,
    )


def usage_buckets(query: UsageQuery) -> list[UsageBucket]:
    """Return the sums a usage read answers; ``InvalidRequest`` past the groups bound."""
    max_groups = conf.usage_api_max_groups()
    buckets = usage_summary(usage_filter=query.usage_filter, group_by=query.group_by,
                            limit=max_groups + 1)
    if len(buckets) > max_groups:
        raise InvalidRequest(
            f"This query makes more than {max_groups} groups; one answer holds at most "
            f"{max_groups}. Shorten the range, filter, or group by fewer dimensions.",
            param="group_by", code="usage_too_many_groups")
    return buckets


def _lookup(model: type[Project | ApiKey], org: Organization, public_ids: tuple[str, ...],
            param: str, *, project_id: int | None = None) -> tuple[int, ...]:
    if not public_ids:
        return ()
    # QuerySet[Any]: project_id is ApiKey's field, and only the key lookup passes it
    objects: QuerySet[Any] = model.objects.filter(organization=org, public_id__in=public_ids)
    if project_id is not None:  # a project-bound caller may not probe other projects' keys
        objects = objects.filter(project_id=project_id)
    found = dict(objects.values_list("public_id", "id"))
    missing = [p for p in public_ids if p not in found]
    if missing:
        raise InvalidRequest(f"No such {param} in this organization: {', '.join(missing)}.",
                             param=param)
    return tuple(found[p] for p in public_ids)

