"""Console usage page: this month's usage by day and model, from the hourly rollups, with a CSV
export. Amounts are shown rounded to the currency's minor unit; the exact sums stay in the CSV.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from billing_platform.accounts.selectors import OrgAccess
from billing_platform.console.views import org_page
from billing_platform.csv_export import csv_writer
from billing_platform.invoicing.money import quantize_money
from metering.selectors import UsageFilter, usage_summary


def _month_so_far() -> tuple[datetime, datetime]:
    now = datetime.now(tz=UTC)
    start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    end = now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    return start, end


@org_page()
def usage(request: HttpRequest, access: OrgAccess) -> HttpResponse:
    start, end = _month_so_far()
    usage_filter = UsageFilter(org_id=access.organization.pk, start=start, end=end)
    rows = usage_summary(usage_filter=usage_filter, group_by=("day", "model"))
    if request.GET.get("format") == "csv":
        response = HttpResponse(content_type="text/csv")
        response["Content-Disposition"] = f'attachment; filename="usage-{start:%Y-%m}.csv"'
        writer = csv_writer(response)
        writer.writerow(["day", "model", "requests", "prompt_tokens", "cached_tokens",
                         "completion_tokens", "amount", "currency"])
        for r in rows:
            writer.writerow([r.group["day"], r.group["model"], r.requests, r.prompt_tokens,
                             r.cached_tokens, r.completion_tokens, r.amount, r.currency])
        return response
    totals = usage_summary(usage_filter=usage_filter, group_by=("model",))
    for r in [*rows, *totals]:
        r.extra["shown_amount"] = quantize_money(r.amount, r.currency)
        r.extra["hit_rate"] = (f"{r.cached_tokens / r.prompt_tokens:.0%}"
                               if r.prompt_tokens else "-")
    return render(request, "console/usage.html",
                  {"rows": rows, "totals": totals, "start": start, "end": end})
