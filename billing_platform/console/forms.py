"""Console forms: validation and error messages for the pages."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

from django import forms
from django.contrib.auth.password_validation import validate_password

from billing_platform.accounts.choices import Role, Scope
from billing_platform.console.once import OnceForm


class SignUpForm(forms.Form):
    email = forms.EmailField()
    password = forms.CharField(widget=forms.PasswordInput, min_length=8)
    org_name = forms.CharField(label="Organization name", max_length=200)

    def clean_password(self) -> str:
        password = self.cleaned_data["password"]
        validate_password(password)
        return password


class ProjectForm(forms.Form):
    name = forms.CharField(max_length=200)


class ApiKeyForm(forms.Form):
    name = forms.CharField(max_length=200)
    scopes = forms.MultipleChoiceField(
        choices=Scope.choices, widget=forms.CheckboxSelectMultiple, initial=[Scope.INFERENCE]
    )
    allowed_models = forms.CharField(
        required=False, help_text="Comma-separated; empty allows every model in your zone."
    )
    expires_in_days = forms.IntegerField(required=False, min_value=1, max_value=3650)

    def __init__(self, *args, grantable: frozenset[str] | None = None, **kwargs) -> None:
        """``grantable``: the scopes the user's role may put on a key (the others are not
        offered; the service refuses them anyway)."""
        super().__init__(*args, **kwargs)
        if grantable is not None:
            field = cast(forms.MultipleChoiceField, self.fields["scopes"])
            field.choices = [(v, label) for v, label in Scope.choices if v in grantable]

    def clean_allowed_models(self) -> list[str]:
        raw = self.cleaned_data["allowed_models"] or ""
        return [m.strip() for m in raw.split(",") if m.strip()]


class InviteForm(forms.Form):
    email = forms.EmailField()
    role = forms.ChoiceField(choices=Role.choices, initial=Role.DEVELOPER)


class RoleForm(forms.Form):
    role = forms.ChoiceField(choices=Role.choices)


# --- plan & credits (plan_views) ---------------------------------------------------------------

class CreditPackBuyForm(OnceForm):
    pack = forms.ChoiceField(label="Credit pack", help_text="Its price is added to your next "
                             "invoice; its credits are used after your plan's own.")

    def __init__(self, *args: Any, packs: Iterable[tuple[str, str]] = (), **kwargs: Any
                 ) -> None:
        super().__init__(*args, **kwargs)
        cast(forms.ChoiceField, self.fields["pack"]).choices = list(packs)


class PlanChangeForm(OnceForm):
    """Confirm a previewed change: ``expected`` is the previewed plan fees; if time moved them
    (proration is by the second), the change is refused and previewed again."""

    plan = forms.ChoiceField(label="New plan")
    expected = forms.CharField(max_length=200, required=False, widget=forms.HiddenInput)

    def __init__(self, *args: Any, plans: Iterable[tuple[str, str]] = (), **kwargs: Any
                 ) -> None:
        super().__init__(*args, **kwargs)
        cast(forms.ChoiceField, self.fields["plan"]).choices = list(plans)


class PlanCancelForm(OnceForm):
    expected = forms.CharField(max_length=200, required=False, widget=forms.HiddenInput)
