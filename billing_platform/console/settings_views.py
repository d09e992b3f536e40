"""Console settings page: rate limits (org usage tier, project and key overrides), monthly
budgets with their alerts, and the billing profile. Thin: a form validates, one service acts."""

from __future__ import annotations

from decimal import Decimal

from django import forms
from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render

from billing_platform.accounts import billing_profile
from billing_platform.accounts.models import Project
from billing_platform.accounts.selectors import OrgAccess
from billing_platform.audit.selectors import quota_audit_events
from billing_platform.console.views import org_page
from billing_platform.errors import DomainError
from plans import limits as rate_limits
from plans import quotas


class LimitsForm(forms.Form):
    scope = forms.CharField(widget=forms.HiddenInput, initial="org")
    # no usage tier: Tollgate staff set it (Django admin or the staff API), customers cannot
    rpm = forms.IntegerField(required=False, min_value=0, label="Requests / minute")
    tpm = forms.IntegerField(required=False, min_value=0, label="Tokens / minute")
    allowed_regions = forms.CharField(required=False, help_text="Comma-separated; empty: all "
                                      "regions of the organization's data zone.")


class BudgetForm(forms.Form):
    scope = forms.CharField(widget=forms.HiddenInput, initial="org")
    amount = forms.DecimalField(min_value=0, max_digits=20, decimal_places=6,
                                label="Monthly amount")
    hard = forms.BooleanField(required=False, initial=True,
                              label="Hard limit (refuse requests at 100 %)")
    thresholds = forms.CharField(
        required=False, initial="50, 80, 100", label="Alert at (% of the amount)",
        help_text="Comma-separated percentages, e.g. 50, 80, 100; each alerts once a month.")
    alert_emails = forms.CharField(required=False, help_text="Comma-separated")
    webhook_url = forms.URLField(required=False, label="Webhook URL", assume_scheme="https")

    def clean_thresholds(self) -> list[int] | None:
        values = _split(self.cleaned_data["thresholds"])
        try:
            return [int(v.rstrip("%").strip()) for v in values] or None
        except ValueError:
            raise forms.ValidationError("Thresholds are whole percentages separated by "
                                        "commas, e.g. 50, 80, 100.") from None


class BillingProfileForm(forms.Form):
    """Shapes only; billing_profile decides what a value must be and who may set it."""

    legal_name = forms.CharField(required=False, max_length=200, label="Legal name")
    address_line1 = forms.CharField(required=False, max_length=200, label="Address")
    address_line2 = forms.CharField(required=False, max_length=200, label="Address, line 2")
    postal_code = forms.CharField(required=False, max_length=20, label="Postal code")
    city = forms.CharField(required=False, max_length=100)
    region = forms.CharField(required=False, max_length=100, label="State / region")
    country = forms.CharField(required=False, max_length=2, label="Country (ISO code)")
    tax_id = forms.CharField(required=False, max_length=40, label="Tax id (VAT, GST)")
    billing_email = forms.EmailField(max_length=254, label="Billing email")
    currency = forms.CharField(required=False, max_length=3)
    tax_rate = forms.DecimalField(required=False, min_value=0, max_value=Decimal("0.9999"),
                                  max_digits=5, decimal_places=4, label="Tax rate (fraction)")


def _split(value: str) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def _scope(access: OrgAccess, scope: str) -> Project | None:
    if scope == "org":
        return None
    return get_object_or_404(Project, organization=access.organization, public_id=scope)


@org_page()
def billing_profile_save(request: HttpRequest, access: OrgAccess) -> HttpResponse:
    """Save the fields of the billing profile the form posted (only those)."""
    if request.method != "POST":
        return redirect("console:settings")
    form = BillingProfileForm(request.POST)
    form.is_valid()
    # the form shows only what the user may change; what it did not post stays as it is
    posted = [name for name in billing_profile.PROFILE_FIELDS if name in request.POST]
    errors = {name: " ".join(str(e) for e in form.errors[name])
              for name in posted if name in form.errors}
    if errors or not posted:
        messages.error(request, "Please correct: " + ("; ".join(
            f"{name}: {text}" for name, text in errors.items()) or "nothing was sent"))
        return redirect("console:settings")
    fields = {name: form.cleaned_data[name] for name in posted}
    if fields.get("tax_rate") is None:
        fields.pop("tax_rate", None)
    try:
        billing_profile.organization_billing_profile_update(
            organization=access.organization, acting_user=request.user, **fields)
    except DomainError as exc:
        messages.error(request, exc.message)
    else:
        messages.success(request, "Billing profile saved.")
    return redirect("console:settings")


@org_page()
def quota_settings(request: HttpRequest, access: OrgAccess) -> HttpResponse:
    org = access.organization
    if request.method == "POST":
        if not access.can("org.write"):
            messages.error(request, f"Your role ({access.role}) cannot change limits or "
                                    "budgets.")
            return redirect("console:settings")
        kind = request.POST.get("kind")
        form = LimitsForm(request.POST) if kind == "limits" else BudgetForm(request.POST)
        if form.is_valid():
            data = form.cleaned_data
            project = _scope(access, data.pop("scope"))
            try:
                if kind == "limits":
                    rate_limits.quota_limit_set(
                        organization=org, project=project, acting_user=request.user,
                        rpm=data["rpm"], tpm=data["tpm"],
                        allowed_regions=_split(data["allowed_regions"]))
                    messages.success(request, "Limits saved.")
                else:
                    quotas.budget_set(
                        organization=org, project=project, actor=request.user,
                        amount=data["amount"], hard=data["hard"],
                        thresholds=data["thresholds"],
                        alert_emails=_split(data["alert_emails"]),
                        webhook_url=data["webhook_url"])
                    messages.success(request, "Budget saved.")
            except DomainError as exc:
                messages.error(request, exc.message)
        else:
            messages.error(request, f"Please correct: {form.errors.as_text()}")
        return redirect("console:settings")
    limits = {(r.project.public_id if r.project is not None else "org"): r
              for r in rate_limits.limits_rows_of(organization=org) if not r.api_key_id}
    org_row = limits.get("org")
    tier = (org_row.usage_tier if org_row and org_row.usage_tier
            else rate_limits.DEFAULT_USAGE_TIER)
    budgets = [quotas.budget_state(budget=b) for b in quotas.budgets_of(organization=org)]
    projects = list(org.projects.order_by("created_at"))
    return render(request, "console/settings.html", {
        "tier": tier, "tier_limits": rate_limits.USAGE_TIERS[tier], "limits": limits,
        "org_limits": org_row, "projects": projects, "budgets": budgets,
        "limits_form": LimitsForm(), "budget_form": BudgetForm(),
        "audit": quota_audit_events(organization=org)[:20],
        "can_write": access.can("org.write"),
        "profile": org if access.can("billing.read") else None,
        "profile_form": BillingProfileForm(initial={
            name: getattr(org, name) for name in billing_profile.PROFILE_FIELDS}),
        "profile_editable": billing_profile.billing_profile_editable(
            organization=org, acting_user=request.user),
    })
