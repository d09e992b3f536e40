"""Console batches page: the organization's Batch API jobs with their progress, the input,
output and error files to download, and a cancel button (as OpenAI's dashboard offers).

The API objects and rules are the gateway's (``gateway.batch.services``/``files``); these views
only render them for a signed-in member. Their domain errors are answered by ``org_page``
(another organization's batch or file is the 404 page); a batch that cannot be cancelled is a
message on the batches page.
"""

from __future__ import annotations

from django.contrib import messages
from django.core.paginator import Paginator
from django.http import FileResponse, Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from billing_platform.accounts.selectors import OrgAccess
from billing_platform.console.views import org_page
from billing_platform.errors import Conflict, InvalidRequest
from billing_platform.gateway.batch import files
from billing_platform.gateway.batch import services as batch_services

PAGE_SIZE = 25


@org_page()
def batches(request: HttpRequest, access: OrgAccess) -> HttpResponse:
    rows = batch_services.batches_for_org(org_id=access.organization.pk).select_related(
        "project")
    page = Paginator(rows, PAGE_SIZE).get_page(request.GET.get("page"))
    for batch in page:
        done = batch.completed + batch.failed
        # for the template only, not a model field
        batch.percent = (  # type: ignore[attr-defined]
            round(100 * done / batch.total) if batch.total else 0)
    return render(request, "console/batches.html", {"page": page})


@org_page("batches.write")
@require_POST
def batch_cancel(request: HttpRequest, access: OrgAccess, batch_id: str) -> HttpResponse:
    batch = batch_services.batch_get(org_id=access.organization.pk, batch_id=batch_id)
    try:
        batch = batch_services.batch_cancel(batch=batch)
    except Conflict as exc:
        messages.error(request, exc.message)
    else:
        messages.success(request, f"Batch {batch.public_id} is {batch.status}: lines not yet "
                                  "run are dropped and not billed; finished lines are kept.")
    return redirect("console:batches")


@org_page()
def batch_file(request: HttpRequest, access: OrgAccess, file_id: str) -> FileResponse:
    file = files.file_get(org_id=access.organization.pk, file_id=file_id)
    try:
        content = files.file_open(file)
    except InvalidRequest as exc:  # gone from storage: there is nothing to download
        raise Http404(exc.message) from exc
    return FileResponse(content, as_attachment=True, filename=file.filename,
                        content_type="application/jsonl")
