"""Django's error page and error e-mail (both built by its ExceptionReporter with the filter our
settings name) never show the password of a connection URL: not in a setting, not in the
request's environment, not in a local variable of the failing code. Host and database stay
visible, since that is what one debugs a connection with.
"""

from __future__ import annotations

import sys

import pytest
from django.test import RequestFactory
from django.views.debug import ExceptionReporter, get_default_exception_reporter_filter

from billing_platform.error_reports import UrlMaskingReporterFilter, mask_url_passwords

REDIS = "redis://:r3dis-pa55@cache.internal:6379/0"
DATABASE = "postgres://tollgate:pg-pa55w0rd@db.internal:5432/tollgate"


def _report(settings, *, text: bool) -> str:
    settings.REDIS_URL = REDIS
    settings.CELERY_BROKER_URL = REDIS
    settings.CACHES = {"default": {**settings.CACHES["default"], "LOCATION": REDIS}}
    request = RequestFactory().get("/console/", DATABASE_URL=DATABASE)

    def connect(url: str) -> None:
        dsn = url  # a local the error page lists with its frame
        raise ConnectionError(f"could not connect to {dsn.split('@')[-1]}")

    try:
        connect(DATABASE)
    except ConnectionError:
        reporter = ExceptionReporter(request, *sys.exc_info())
    return reporter.get_traceback_text() if text else reporter.get_traceback_html()


@pytest.mark.parametrize("text", [False, True], ids=["debug page", "error e-mail"])
def test_error_reports_mask_connection_url_passwords_and_keep_the_hosts(settings, text):
    # given DEBUG (the page shows settings) and an error while the URLs are in play
    settings.DEBUG = True

    # when Django builds the error page / the text of the error e-mail
    report = _report(settings, text=text)

    # then neither password appears anywhere, and the hosts still do
    assert "r3dis-pa55" not in report
    assert "pg-pa55w0rd" not in report
    assert "cache.internal:6379" in report
    assert "db.internal:5432" in report
    assert "********@" in report


def test_the_settings_name_the_masking_filter():
    assert isinstance(get_default_exception_reporter_filter(), UrlMaskingReporterFilter)


@pytest.mark.parametrize(("raw", "masked"), [
    ("redis://:secret@host:6379/0", "redis://:********@host:6379/0"),
    ("postgres://user:p%40ss@db:5432/x", "postgres://user:********@db:5432/x"),
    ("smtp://mailer:pw@smtp.example.com:587", "smtp://mailer:********@smtp.example.com:587"),
    ("postgres://postgres@127.0.0.1:5432/tollgate", "postgres://postgres@127.0.0.1:5432/tollgate"),
    ("http://127.0.0.1:8000/console/", "http://127.0.0.1:8000/console/"),
    ("two: amqp://a:b@h1/ and redis://:c@h2/1", "two: amqp://a:********@h1/ and "
                                                "redis://:********@h2/1"),
])
def test_mask_url_passwords(raw, masked):
    assert mask_url_passwords(raw) == masked
