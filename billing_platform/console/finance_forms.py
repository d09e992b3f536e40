"""Forms of the finance workspace's operations (``/finance/``, ``finance_operations``).

Every operation form carries a required ``reason`` (kept in the audit row) and a hidden
``idempotency_key``, a new one each time the form is rendered: sending the same form twice (a
double click, a reload that re-posts) does the operation once (``idempotency.idempotent_call``).
Amounts are decimal strings in the invoice's or organization's currency; the services check
them against what the invoice allows and raise the domain error the form then shows.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, time
from decimal import Decimal
from typing import Any

from django import forms

from billing_platform.console.once import OnceForm
from billing_platform.invoicing.choices import CreditOutcome
from plans.choices import CreditGrantKind

MAX_AMOUNT = Decimal("1000000000")
# what finance grants by hand (credit packs are bought, credit-note grants come from notes)
GRANT_KINDS = [(k.value, k.label) for k in CreditGrantKind if k.value in ("promotional",
                                                                           "goodwill")]


def _new_key() -> str:
    return uuid.uuid4().hex


class OperationForm(OnceForm):
    """What every operation asks: why (audited), and the key that makes it happen once."""

    reason = forms.CharField(max_length=500, widget=forms.TextInput(
        attrs={"placeholder": "why (kept in the audit log)"}))

    def clean_reason(self) -> str:
        reason = str(self.cleaned_data["reason"]).strip()
        if not reason:
            raise forms.ValidationError("Say why: the reason is kept in the audit log.")
        return reason


def _amount_field(**kwargs: Any) -> forms.DecimalField:
    return forms.DecimalField(min_value=Decimal("0.01"), max_value=MAX_AMOUNT,
                              max_digits=16, decimal_places=4, **kwargs)


class VoidForm(OperationForm):
    pass


class MarkPaidForm(OperationForm):
    reference = forms.CharField(max_length=200, label="Bank transfer reference")


class RetryForm(OperationForm):
    pass


class DunningForm(OperationForm):
    pass


class WriteOffForm(OperationForm):
    pass


class CreditNoteForm(OperationForm):
    """By amount, or by lines (all that is left of each line ticked); on a paid invoice,
    a refund through Stripe or a credit balance."""

    amount = _amount_field(required=False, help_text="leave empty to credit the lines ticked")
    lines = forms.TypedMultipleChoiceField(coerce=int, required=False,
                                           widget=forms.CheckboxSelectMultiple)
    outcome = forms.ChoiceField(required=False, widget=forms.RadioSelect, choices=[
        (CreditOutcome.REFUND.value, "Refund through Stripe"),
        (CreditOutcome.CREDIT_BALANCE.value, "Credit balance for later invoices")],
        help_text="for a paid invoice; an unpaid one's amount due is reduced")

    def __init__(self, *args: Any, positions: list[tuple[int, str]] | None = None,
                 paid: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        lines = self.fields["lines"]
        assert isinstance(lines, forms.TypedMultipleChoiceField)  # noqa: S101 - declared above
        lines.choices = positions or []
        if not paid:
            del self.fields["outcome"]
        else:
            self.fields["outcome"].required = True

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if (data.get("amount") is None) == (not data.get("lines")):
            raise forms.ValidationError("Give an amount, or tick the lines to credit (not both).")
        return data


class CloseForm(OperationForm):
    organization = forms.CharField(max_length=40, required=False,
                                   help_text="an organization's id; empty: every one due")
    # which of the close page's two forms was sent (the preview's says "preview")
    step = forms.CharField(widget=forms.HiddenInput, initial="run")


class ClosePreviewForm(forms.Form):
    organization = forms.CharField(max_length=40, required=False,
                                   help_text="an organization's id; empty: every one due")


class GrantForm(OperationForm):
    kind = forms.ChoiceField(choices=GRANT_KINDS)
    amount = _amount_field()
    expires_on = forms.DateField(required=False, widget=forms.DateInput(attrs={"type": "date"}),
                                 help_text="UTC; empty: never expires")

    def clean_expires_on(self) -> datetime | None:
        day = self.cleaned_data.get("expires_on")
        if day is None:
            return None
        at = datetime.combine(day, time(0), tzinfo=UTC)
        if at <= datetime.now(tz=UTC):
            raise forms.ValidationError("The expiry must be in the future.")
        return at


class OneOffItemForm(OperationForm):
    description = forms.CharField(max_length=300)
    amount = _amount_field()
