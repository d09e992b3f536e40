"""What Django's error pages and error e-mails may show.

Django's own filter hides settings whose *name* looks secret (``...PASSWORD``, ``SECRET_KEY``),
but a connection URL carries its password in the *value*: ``REDIS_URL``,
``CELERY_BROKER_URL``, ``CACHES["default"]["LOCATION"]``, ``DATABASE_URL`` in the request's
environment under a WSGI server, or a local variable of the failing frame. This filter masks the
password of every URL it is about to show, wherever it appears, and keeps the rest (scheme,
user, host, port, database) because that is what one needs to debug a connection.
"""

from __future__ import annotations

import re
from typing import Any

from django.views.debug import SafeExceptionReporterFilter

# scheme://user:password@  ->  scheme://user:********@   (a password may hold anything but @ / \s)
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*:)[^@/\s]+@")


def mask_url_passwords(text: str) -> str:
    """Return ``text`` with the password of every URL in it replaced by ``********``."""
    return _URL_PASSWORD.sub(r"\g<head>********@", text)


def _masked(value: Any) -> Any:
    if isinstance(value, str):
        return mask_url_passwords(value)
    if isinstance(value, dict):
        return {k: _masked(v) for k, v in value.items()}
    if type(value) in (list, tuple):  # not subclasses: a namedtuple takes other arguments
        return type(value)(_masked(v) for v in value)
    return value


class UrlMaskingReporterFilter(SafeExceptionReporterFilter):
    """Django's filter, plus masked passwords in URLs of settings, request META and frames."""

    def cleanse_setting(self, key: Any, value: Any) -> Any:
        # Django recurses into dicts through this method, so nested values are covered too.
        return _masked(super().cleanse_setting(key, value))

    def get_traceback_frame_variables(self, request: Any, tb_frame: Any) -> Any:
        return [(name, _masked(value))
                for name, value in super().get_traceback_frame_variables(request, tb_frame)]
