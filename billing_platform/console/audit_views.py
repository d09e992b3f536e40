"""Console audit log: who changed what in the organization (owners and admins). Read-only."""

from __future__ import annotations

from django import forms
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from billing_platform.accounts.selectors import OrgAccess
from billing_platform.audit.selectors import audit_events
from billing_platform.console.views import org_page

PAGE = 50


class AuditFilterForm(forms.Form):
    action = forms.CharField(required=False, max_length=60,
                             help_text="a prefix, e.g. api_key. or member.")
    actor = forms.CharField(required=False, max_length=200, help_text="email or api-key:<prefix>")
    before = forms.IntegerField(required=False, min_value=1, widget=forms.HiddenInput)


@org_page("audit.read")
def audit_log(request: HttpRequest, access: OrgAccess) -> HttpResponse:
    form = AuditFilterForm(request.GET or None)
    rows = audit_events(organization=access.organization)
    if form.is_valid():
        data = form.cleaned_data
        rows = audit_events(organization=access.organization, action=data["action"],
                            actor=data["actor"])
        if data["before"]:
            rows = rows.filter(id__lt=data["before"])
    page = list(rows[:PAGE + 1])
    more, page = len(page) > PAGE, page[:PAGE]
    query = request.GET.copy()
    if more:
        query["before"] = str(page[-1].pk)
    return render(request, "console/audit.html", {
        "form": form, "events": page, "older": query.urlencode() if more else ""})
