"""Console pages. Thin views: a form validates, one service acts, a template renders."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from datetime import timedelta
from functools import wraps
from typing import Any, cast

from django.contrib import messages
from django.contrib.auth import login
from django.contrib.auth.decorators import login_required
from django.core.exceptions import BadRequest, PermissionDenied
from django.forms import ChoiceField
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST

from billing_platform.accounts import services
from billing_platform.accounts.choices import scopes_grantable
from billing_platform.accounts.models import ApiKey, Membership, Project, User
from billing_platform.accounts.selectors import (
    OrgAccess,
    api_keys_for_project,
    org_access,
    organizations_for_user,
)
from billing_platform.console import forms
from billing_platform.errors import DomainError, Forbidden, NotFound
from billing_platform.finance.permissions import can_read_finance

SESSION_ORG = "console_org"


def _resolve_access(request: HttpRequest) -> OrgAccess | None:
    wanted = request.session.get(SESSION_ORG)
    if wanted:
        try:
            return org_access(user=request.user, principal=None, org_public_id=wanted)
        except NotFound:
            request.session.pop(SESSION_ORG, None)
    first = organizations_for_user(user=cast(User, request.user)).first()  # signed in
    if first is None:
        return None
    request.session[SESSION_ORG] = first.public_id
    return org_access(user=request.user, principal=None, org_public_id=first.public_id)


def org_page(permission: str = "read") -> Callable:
    """Require login and a current organization in which the user holds ``permission``."""

    def decorator(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
        @login_required
        @wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            access = _resolve_access(request)
            if access is None:  # no organization: the platform's finance team has its own pages
                return redirect("finance:home" if can_read_finance(request.user)
                                else "console:signup")
            request.org_access = access  # type: ignore[attr-defined]
            if not access.can(permission):
                messages.error(request, f"Your role ({access.role}) cannot do that.")
                return redirect("console:dashboard")
            try:
                return view(request, access, *args, **kwargs)
            except DomainError as exc:
                return domain_error_page(request, exc)

        return wrapper

    return decorator


def domain_error_page(request: HttpRequest, exc: DomainError) -> HttpResponse:
    """Answer a domain error a page did not turn into a form error: the console's one place.

    NotFound is the 404 page (another organization's id reads as nothing there), Forbidden the
    403 page. Any other error of a form post goes back to the page the form was on, with the
    message; on a page load it is the 400 page. No domain error is a 500.
    """
    if isinstance(exc, NotFound):
        raise Http404(exc.message) from exc
    if isinstance(exc, Forbidden):
        raise PermissionDenied(exc.message) from exc
    if request.method != "POST":
        raise BadRequest(exc.message) from exc
    messages.error(request, exc.message)
    back = request.headers.get("referer", "")
    if url_has_allowed_host_and_scheme(back, allowed_hosts={request.get_host()},
                                       require_https=request.is_secure()):
        return redirect(back)
    return redirect("console:dashboard")


def signup(request: HttpRequest) -> HttpResponse:
    form = forms.SignUpForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            user, org = services.user_sign_up(**form.cleaned_data)
        except DomainError as exc:
            form.add_error(exc.param if exc.param in form.fields else None, exc.message)
        else:
            login(request, user, backend="django.contrib.auth.backends.ModelBackend")
            request.session[SESSION_ORG] = org.public_id
            messages.success(request, f"Welcome! {org.name} is ready.")
            return redirect("console:dashboard")
    return render(request, "console/signup.html", {"form": form})


@login_required
@require_POST
def switch_org(request: HttpRequest) -> HttpResponse:
    try:
        access = org_access(user=request.user, principal=None,
                            org_public_id=request.POST.get("org", ""))
    except NotFound:
        messages.error(request, "No such organization.")
    else:
        request.session[SESSION_ORG] = access.organization.public_id
    return redirect("console:dashboard")


@org_page()
def projects(request: HttpRequest, access: OrgAccess) -> HttpResponse:
    form = forms.ProjectForm(request.POST or None)
    if request.method == "POST":
        if not access.can("projects.write"):
            messages.error(request, f"Your role ({access.role}) cannot create projects.")
            return redirect("console:projects")
        if form.is_valid():
            project = services.project_create(organization=access.organization,
                                              name=form.cleaned_data["name"])
            messages.success(request, f"Project {project.name} created.")
            return redirect("console:projects")
    projects = access.organization.projects.order_by("created_at")
    return render(request, "console/projects.html", {"projects": projects, "form": form})


def _project(access: OrgAccess, project_id: str) -> Project:
    return get_object_or_404(Project, organization=access.organization, public_id=project_id)


@org_page()
def api_keys(request: HttpRequest, access: OrgAccess, project_id: str) -> HttpResponse:
    project = _project(access, project_id)
    grantable = scopes_grantable(access.role)
    form = forms.ApiKeyForm(request.POST or None, grantable=grantable)
    secret = None
    if request.method == "POST":
        if not access.can("keys.write"):
            messages.error(request, f"Your role ({access.role}) cannot create keys.")
            return redirect("console:api-keys", project_id=project.public_id)
        if not _take_form_nonce(request):
            # A reload or double click re-sent the form: create nothing twice.
            messages.info(request, "That form was already submitted; no new key was created.")
            return redirect("console:api-keys", project_id=project.public_id)
        if form.is_valid():
            days = form.cleaned_data.pop("expires_in_days")
            try:
                key, secret = services.api_key_create(
                    project=project, acting_user=request.user,
                    expires_at=timezone.now() + timedelta(days=days) if days else None,
                    **form.cleaned_data,
                )
            except DomainError as exc:
                form.add_error(exc.param if exc.param in form.fields else None, exc.message)
            else:
                form = forms.ApiKeyForm(grantable=grantable)
                messages.success(request, f"Key {key.name} created. Copy it now: it is "
                                          "shown only once.")
    keys = api_keys_for_project(project_id=project.pk)
    return render(request, "console/api_keys.html",
                  {"project": project, "keys": keys, "form": form, "secret": secret,
                   "form_nonce": _new_form_nonce(request)})


FORM_NONCES = "console_form_nonces"


def _new_form_nonce(request: HttpRequest) -> str:
    """Issue a one-time token for a form whose result is shown once (the secret)."""
    nonce = secrets.token_urlsafe(16)
    request.session[FORM_NONCES] = [*request.session.get(FORM_NONCES, [])[-19:], nonce]
    return nonce


def _take_form_nonce(request: HttpRequest) -> bool:
    nonces = request.session.get(FORM_NONCES, [])
    nonce = request.POST.get("form_nonce")
    if nonce not in nonces:
        return False
    request.session[FORM_NONCES] = [n for n in nonces if n != nonce]
    return True


@org_page("keys.write")
def api_key_revoke(request: HttpRequest, access: OrgAccess, project_id: str,
                   key_id: str) -> HttpResponse:
    project = _project(access, project_id)
    key = get_object_or_404(ApiKey, project=project, public_id=key_id)
    if request.method == "POST":
        try:
            services.api_key_revoke(api_key=key, acting_user=request.user)
        except DomainError as exc:
            messages.error(request, exc.message)
            return redirect("console:api-keys", project_id=project.public_id)
        messages.success(request, f"Key {key.name} revoked. It stopped working immediately.")
        return redirect("console:api-keys", project_id=project.public_id)
    return render(request, "console/api_key_revoke.html", {"project": project, "key": key})


@org_page()
def members(request: HttpRequest, access: OrgAccess) -> HttpResponse:
    form = forms.InviteForm(request.POST or None)
    if request.method == "POST":
        if not access.can("members.write"):
            messages.error(request, f"Your role ({access.role}) cannot invite members.")
            return redirect("console:members")
        if form.is_valid():
            try:
                services.member_invite(organization=access.organization,
                                       acting_user=cast(User, request.user),  # signed in
                                       **form.cleaned_data)
            except DomainError as exc:
                form.add_error(exc.param if exc.param in form.fields else None, exc.message)
            else:
                messages.success(request, f"Invitation sent to {form.cleaned_data['email']}.")
                return redirect("console:members")
    memberships = access.organization.memberships.select_related("user").order_by("created_at")
    pending = access.organization.invitations.filter(accepted_at__isnull=True,
                                                      expires_at__gt=timezone.now())
    return render(request, "console/members.html", {
        "memberships": memberships, "pending": pending, "form": form,
        "roles": cast(ChoiceField, forms.RoleForm.base_fields["role"]).choices,
    })


@org_page("members.write")
@require_POST
def member_role(request: HttpRequest, access: OrgAccess, member_id: int) -> HttpResponse:
    membership = get_object_or_404(Membership, organization=access.organization, pk=member_id)
    form = forms.RoleForm(request.POST)
    if form.is_valid():
        try:
            services.member_set_role(membership=membership, role=form.cleaned_data["role"],
                                     acting_user=request.user)
        except DomainError as exc:
            messages.error(request, exc.message)
        else:
            messages.success(request, f"{membership.user.email} is now {membership.role}.")
    return redirect("console:members")


@login_required
def invitation_accept(request: HttpRequest, token: str) -> HttpResponse:
    if request.method == "POST":
        try:
            membership = services.invitation_accept(token=token,
                                                    user=cast(User, request.user))  # signed in
        except DomainError as exc:
            messages.error(request, exc.message)
            return redirect("console:dashboard")
        request.session[SESSION_ORG] = membership.organization.public_id
        messages.success(request, f"You joined {membership.organization.name}.")
        return redirect("console:dashboard")
    return render(request, "console/invitation.html", {"token": token})


# --- invoices (billing.read: owner, admin, finance) -------------------------------------------

def _invoice(access: OrgAccess, invoice_id: str):
    from billing_platform.invoicing.selectors import invoice_get

    invoice = invoice_get(organization=access.organization, public_id=invoice_id)
    if invoice is None or invoice.status == "draft":
        raise Http404("No such invoice.")
    return invoice


@org_page("billing.read")
def invoices(request: HttpRequest, access: OrgAccess) -> HttpResponse:
    from billing_platform.invoicing.selectors import invoices_of, upcoming_invoice

    return render(request, "console/invoices.html", {
        "invoices": invoices_of(organization=access.organization)[:100],
        "upcoming": upcoming_invoice(organization=access.organization),
    })


@org_page("billing.read")
def invoice_document(request: HttpRequest, access: OrgAccess, invoice_id: str,
                     fmt: str = "html") -> HttpResponse:
    """Return an invoice (or ``upcoming``) as HTML, PDF or CSV, all from the one template."""
    from billing_platform.invoicing import rendering
    from billing_platform.invoicing.selectors import upcoming_invoice

    if invoice_id == "upcoming":
        invoice, name = upcoming_invoice(organization=access.organization), "upcoming"
    else:
        invoice = _invoice(access, invoice_id)
        name = invoice.number
    if fmt == "pdf":
        response = HttpResponse(rendering.invoice_pdf(invoice, access.organization),
                                content_type="application/pdf")
        response["Content-Disposition"] = f'inline; filename="{name}.pdf"'
        return response
    if fmt == "csv":
        response = HttpResponse(rendering.invoice_csv(invoice), content_type="text/csv")
        response["Content-Disposition"] = f'attachment; filename="{name}.csv"'
        return response
    return HttpResponse(rendering.invoice_html(invoice, access.organization,
                                               # set by django-csp's middleware
                                               csp_nonce=str(request.csp_nonce)))  # type: ignore[attr-defined]
