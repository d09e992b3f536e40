"""What a visitor sees when the login throttle (django-axes, see settings) has locked them out.

Axes decides when; this renders the console's own login page with a message on the form, and
answers 429 so scripts see the throttle for what it is. The password is never checked while a
(username, address) pair is locked out, so even the right one is refused until the cool-off ends.
"""

from __future__ import annotations

from typing import Any

from axes.helpers import get_client_username, get_cool_off
from django.contrib.auth.forms import AuthenticationForm
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

LOCKED_OUT_STATUS = 429


def login_locked_out(request: HttpRequest, *_args: Any) -> HttpResponse:
    """Return the login page saying the login is locked and for how long (axes' lockout hook)."""
    # Axes passes (response, credentials) or, on its async path, only the credentials; the
    # credentials it collected are on the request either way.
    username = get_client_username(request, getattr(request, "axes_credentials", None)) or ""
    cool_off = get_cool_off(request)
    minutes = max(1, round(cool_off.total_seconds() / 60)) if cool_off else None
    wait = (f"Try again in {minutes} minute{'s' if minutes != 1 else ''}" if minutes
            else "Ask an administrator to unlock it")
    message = (f"Too many failed login attempts for {username or 'this account'} from your "
               f"address, so logging in is locked for now. {wait}.")
    form = AuthenticationForm(request, initial={"username": username})
    return render(request, "console/login.html", {"form": form, "locked_out": message},
                  status=LOCKED_OUT_STATUS)
