"""Console data-residency page (issue 19 item 7): the organization's zone and the regions it
allows, where its requests ran in a chosen range (a chart and a table of the same numbers),
and a proof to download as CSV or JSON (``?format=csv|json``).

The figures are ``plans.residency.residency_report``'s, taken from the zone stored on each
usage event, never from the organization's current setting; the page, its chart and both
proofs show the same report, so they agree to the event. The proof streams: its header and
the per-region counts are computed first (they carry the digest), then the events outside the
zone, if any, are read and written row by row, so a long list never sits in memory.

Only members who read billing (owner, admin, finance) see the page: the proof is a document
for finance and compliance, like invoices. The organization is the session's, never a
parameter: the console has no way to name another organization here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from datetime import UTC, date, datetime, timedelta
from itertools import islice
from typing import Any

from django import forms
from django.http import HttpRequest, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django.shortcuts import render
from django.utils import timezone

from billing_platform.accounts.choices import DataZone
from billing_platform.accounts.selectors import OrgAccess
from billing_platform.console.views import org_page
from billing_platform.csv_export import csv_writer
from billing_platform.db import replica_report
from plans.residency import PROOF_VERSION, ResidencyReport, residency_report

MAX_DAYS = 366  # the longest range one page reads, as the usage explorer's
MONTHS = 12  # past months offered as one-click ranges
FORMATS = ("csv", "json")
SHOWN_OUTSIDE = 20  # events outside the zone listed on the page (the proof lists them all)


class RangeForm(forms.Form):
    """The range: ``start`` and ``through`` (the last day, inclusive), UTC days."""

    start = forms.DateField(label="From (UTC)", input_formats=["%Y-%m-%d"])
    through = forms.DateField(label="Through (last day, inclusive)",
                              input_formats=["%Y-%m-%d"])

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        start, through = data.get("start"), data.get("through")
        if start and through:
            if through < start:
                raise forms.ValidationError("The last day is before the first.")
            if (through - start).days + 1 > MAX_DAYS:
                raise forms.ValidationError(f"A range is at most {MAX_DAYS} days.")
            if through >= date.max - timedelta(days=1):
                raise forms.ValidationError("The last day is too far in the future.")
        return data


def _months(today: date) -> list[dict[str, str]]:
    """This month (through today) and the previous ``MONTHS``, as form values."""
    out, first = [], today.replace(day=1)
    for i in range(MONTHS + 1):
        last = today if i == 0 else (first + timedelta(days=32)).replace(day=1) - timedelta(1)
        out.append({"label": "This month" if i == 0 else f"{first:%B %Y}",
                    "start": first.isoformat(), "through": last.isoformat()})
        first = (first - timedelta(days=1)).replace(day=1)
    return out


def _day(d: date) -> datetime:
    return datetime(d.year, d.month, d.day, tzinfo=UTC)


def _zone_label(zone: str) -> str:
    return dict(DataZone.choices).get(zone, zone)


def _rows(report: ResidencyReport) -> list[dict[str, Any]]:
    """The table's rows (and the chart's bars): one per region x recorded zone."""
    several = len(report.zones_recorded) > 1
    return [{"label": (r.count.region or "(no engine reached)")
             + (f" ({r.count.data_zone})" if several else ""),
             "region": r.count.region, "zone": r.count.data_zone, "in_zone": r.in_zone,
             "events": r.count.events, "prompt_tokens": r.count.prompt_tokens,
             "completion_tokens": r.count.completion_tokens,
             "total_tokens": r.count.total_tokens} for r in report.rows]


def _chart(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "bar", "labels": [r["label"] for r in rows],
            "datasets": [{"label": "Requests", "data": [r["events"] for r in rows],
                          "axis": "y"},
                         {"label": "Tokens (input + output)",
                          "data": [r["total_tokens"] for r in rows], "axis": "tokens"}]}


def _header(report: ResidencyReport, generated_at: datetime) -> dict[str, Any]:
    org = report.organization
    allowed = report.allowed_regions
    return {
        "proof": PROOF_VERSION,
        "organization": org.public_id, "organization_name": org.name,
        "zone": report.zone,
        "zone_allows": "every region" if allowed is None else allowed,
        "start": report.start.isoformat(), "end": report.end.isoformat(),
        "generated_at": generated_at.isoformat(),
        "total_events": report.events, "events_outside_zone": report.outside,
        "zones_recorded": report.zones_recorded,
        "digest_sha256": report.digest,
        "digest_over": "the UTF-8 lines of digest_text: proof, organization, zone, start, end, "
                       "events, events_outside_zone, then one line per region x zone "
                       "recorded, sorted (generated_at is not in it)",
        "digest_text": report.digest_text(),
        "regions": [{"region": r.count.region, "zone_recorded": r.count.data_zone,
                     "in_zone": r.in_zone, "events": r.count.events,
                     "prompt_tokens": r.count.prompt_tokens,
                     "completion_tokens": r.count.completion_tokens,
                     "total_tokens": r.count.total_tokens} for r in report.rows],
    }


def _outside_rows(outside: Iterator[Mapping[str, Any]]) -> Iterator[dict[str, str]]:
    for e in outside:
        at = e["event_time"]
        yield {"request_id": str(e["request_id"]),
               "event_time": at.astimezone(UTC).isoformat() if isinstance(at, datetime)
               else str(at),
               "region": str(e["region"]), "zone_recorded": str(e["data_zone"])}


def _json_proof(report: ResidencyReport, generated_at: datetime,
                outside: Iterator[Mapping[str, Any]]) -> Iterator[str]:
    head = json.dumps(_header(report, generated_at), indent=1)
    yield head[:-2] + ',\n "outside_events": ['
    for i, row in enumerate(_outside_rows(outside)):
        yield ("," if i else "") + "\n  " + json.dumps(row)
    yield "\n ]\n}\n"


class _Echo:
    def write(self, value: str) -> str:
        return value


def _csv_proof(report: ResidencyReport, generated_at: datetime,
               outside: Iterator[Mapping[str, Any]]) -> Iterator[str]:
    writer = csv_writer(_Echo())
    head = _header(report, generated_at)
    yield writer.writerow(["field", "value"])
    for name in ("proof", "organization", "organization_name", "zone", "zone_allows", "start",
                 "end", "generated_at", "total_events", "events_outside_zone",
                 "zones_recorded", "digest_sha256", "digest_over"):
        value = head[name]
        yield writer.writerow([name, ";".join(value) if isinstance(value, list) else value])
    yield writer.writerow([])
    columns = ["region", "zone_recorded", "in_zone", "events", "prompt_tokens",
               "completion_tokens", "total_tokens"]
    yield writer.writerow(columns)
    for r in head["regions"]:
        yield writer.writerow([str(r[c]).lower() if c == "in_zone" else r[c] for c in columns])
    yield writer.writerow([])
    yield writer.writerow(["outside_events: request_id", "event_time", "region",
                           "zone_recorded"])
    listed = 0
    for row in _outside_rows(outside):
        listed += 1
        yield writer.writerow(row.values())
    if not listed:
        yield writer.writerow(["none"])


@org_page("billing.read")
@replica_report  # may lag the primary by DATABASE_REPLICA_MAX_LAG_S (billing_platform/db.py)
def page(request: HttpRequest, access: OrgAccess) -> HttpResponseBase:
    """The residency page for a range (default: this month); ``?format=csv|json``: its proof."""
    now = timezone.now()
    today = now.date()
    months = _months(today)
    form = RangeForm(request.GET if "start" in request.GET or "through" in request.GET
                     else {"start": months[0]["start"], "through": months[0]["through"]})
    context: dict[str, Any] = {"form": form, "months": months}
    fmt = request.GET.get("format", "")
    if not form.is_valid() or (fmt and fmt not in FORMATS):
        if fmt and fmt not in FORMATS:
            form.add_error(None, "The proof's format is csv or json.")
        return render(request, "console/residency.html", context, status=400)
    start = _day(form.cleaned_data["start"])
    end = _day(form.cleaned_data["through"]) + timedelta(days=1)
    report = residency_report(organization=access.organization, start=start, end=end)
    if fmt:
        # the events outside are read as the response streams, after this view returns, from
        # the database this view reads (bound now, inside ``replica_report``)
        lines = (_csv_proof if fmt == "csv" else _json_proof)(report, now,
                                                              report.outside_events())
        response = StreamingHttpResponse(
            lines, content_type="text/csv" if fmt == "csv" else "application/json")
        name = (f"residency-{report.organization.public_id}-{start:%Y%m%d}-"
                f"{end - timedelta(days=1):%Y%m%d}.{fmt}")
        response["Content-Disposition"] = f'attachment; filename="{name}"'
        return response
    rows = _rows(report)
    query = f"start={start:%Y-%m-%d}&through={end - timedelta(days=1):%Y-%m-%d}"
    outside = list(islice(_outside_rows(report.outside_events()), SHOWN_OUTSIDE))
    context.update(report=report, rows=rows, outside_events=outside, chart=_chart(rows),
                   generated_at=now,
                   zone_label=_zone_label(report.zone), query=query,
                   range_through=end - timedelta(days=1),
                   totals={k: sum(r[k] for r in rows) for k in
                           ("events", "prompt_tokens", "completion_tokens", "total_tokens")},
                   zone_regions=sorted((z, sorted(r)) for z, r in report.zone_regions.items()))
    return render(request, "console/residency.html", context)
