"""Console forms that move money or change what is billed, sent once.

``OnceForm`` carries a hidden ``idempotency_key``, a new one each time the form is rendered;
``run_once`` runs the action through ``idempotency.idempotent_call`` under that key, so a
double click or a reload that re-posts does it once and says so. Used by the finance
workspace's operations, the plan page and the billing page.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable
from typing import Any

from django import forms
from django.contrib import messages
from django.http import HttpRequest

from billing_platform.errors import DomainError
from billing_platform.idempotency.services import MAX_KEY, idempotent_call


class OnceForm(forms.Form):
    """A form whose action happens once per rendering (see the module)."""

    idempotency_key = forms.CharField(max_length=MAX_KEY, widget=forms.HiddenInput)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("initial", {}).setdefault("idempotency_key", uuid.uuid4().hex)
        super().__init__(*args, **kwargs)

    def clean(self) -> dict[str, Any] | None:
        if "idempotency_key" in self.errors:  # a hidden field: say it where it is seen
            self.add_error(None, "This form is out of date or damaged; reload the page and "
                                 "send it again.")
        return super().clean()

    def audited(self) -> dict[str, Any]:
        """Return what was asked, without the key."""
        return {k: v for k, v in self.cleaned_data.items() if k != "idempotency_key"}


def run_once(request: HttpRequest, form: OnceForm, *, operation: Any,
             call: Callable[[], str]) -> bool:
    """Run ``call`` (which returns the success message) once per form key; True when done.

    ``operation`` (any JSON value: what is done, to what, with which fields) is the key's
    fingerprint: the same key sent with another operation is refused. A domain error becomes
    the form's message (on the field it names, when the form has it).
    """
    fingerprint = hashlib.sha256(json.dumps(operation, sort_keys=True, default=str)
                                 .encode()).hexdigest()
    try:
        result, replayed = idempotent_call(
            caller=f"user:{request.user.pk}", key=form.cleaned_data["idempotency_key"],
            fingerprint=fingerprint, call=lambda: {"message": call()})
    except DomainError as exc:
        form.add_error(exc.param if exc.param in form.fields else None, exc.message)
        return False
    if replayed:
        messages.info(request, f"This form was already sent: {result['message']} "
                               "(nothing was done again).")
    else:
        messages.success(request, result["message"])
    return True
