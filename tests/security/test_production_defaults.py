"""Production mode (TOLLGATE_ENV=production) as an operator meets it: the web process refuses to
start without ALLOWED_HOSTS and says which variable to set; with it, cookies are HTTPS-only,
HSTS is sent on HTTPS requests (through the proxy header the operator names), the console
carries a Content-Security-Policy, and other Host headers are refused.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys

import httpx
import pytest

from tests.conftest import ROOT
from tests.factories import UserFactory
from tests.gateway.conftest import start_gateway, stop_gateway
from tests.gateway.conftest import test_database_url as database_url

pytestmark = pytest.mark.django_db(transaction=True)


def production_env(**extra: str) -> dict[str, str]:
    """The environment of a production start, with every required secret set."""
    env = {k: v for k, v in os.environ.items()
           if k not in {"ALLOWED_HOSTS", "DEBUG", "TOLLGATE_SECURE_PROXY_SSL_HEADER",
                        "TOLLGATE_HSTS_SECONDS"}}
    env.update({
        "TOLLGATE_ENV": "production",
        "SECRET_KEY": secrets.token_urlsafe(50),
        "STRIPE_WEBHOOK_SECRET": "whsec_" + secrets.token_hex(16),
        "DATABASE_URL": database_url(),
        **extra,
    })
    return env


def test_production_web_process_refuses_to_start_without_allowed_hosts():
    # when the operator starts the web process in production without ALLOWED_HOSTS
    result = subprocess.run(
        [sys.executable, "-m", "uvicorn", "billing_platform.asgi:application", "--port", "0",
         "--lifespan", "off"],
        cwd=ROOT, env=production_env(), capture_output=True, text=True, timeout=120)

    # then it does not start, and the last words say which variable to set
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert "ALLOWED_HOSTS" in last_line and "refusing to start" in last_line


def test_a_malformed_proxy_ssl_header_setting_is_refused_at_start():
    result = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=ROOT, capture_output=True, text=True,
        env=production_env(ALLOWED_HOSTS="billing.example.com",
                           TOLLGATE_SECURE_PROXY_SSL_HEADER="https"), timeout=120)
    assert result.returncode != 0
    assert "TOLLGATE_SECURE_PROXY_SSL_HEADER must look like" in result.stderr


def test_production_deploy_check_finds_no_cookie_hsts_or_host_problem():
    # when Django's own deployment check runs with the production settings
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy"], cwd=ROOT, capture_output=True,
        text=True, env=production_env(ALLOWED_HOSTS="billing.example.com"), timeout=120)

    # then none of the warnings about cookies, HSTS, hosts, the secret key or DEBUG is raised
    assert result.returncode == 0, result.stderr
    output = result.stdout + result.stderr
    for warning in ("security.W004", "security.W009", "security.W012", "security.W016",
                    "security.W018", "security.W020"):
        assert warning not in output, output


@pytest.fixture
def production_web(tmp_path):
    server = start_gateway(tmp_path, env=production_env(
        ALLOWED_HOSTS="127.0.0.1", TOLLGATE_SECURE_PROXY_SSL_HEADER="X-Forwarded-Proto: https"))
    yield server
    stop_gateway(server)


def test_production_cookies_are_secure_hsts_is_sent_and_other_hosts_are_refused(production_web):
    # given a member, and the web process in production behind a TLS-terminating proxy
    UserFactory(email="ops@example.com")
    base = production_web.url
    https = {"X-Forwarded-Proto": "https"}

    with httpx.Client(base_url=base, headers=https) as browser:
        # when the proxy forwards an HTTPS request for the login page
        page = browser.get("/console/login/")

        # then the answer tells the browser to stay on HTTPS, carries the CSP, and its CSRF
        # cookie travels over HTTPS only
        assert page.status_code == 200
        assert page.headers["strict-transport-security"] == "max-age=31536000"
        assert "default-src 'self'" in page.headers["content-security-policy"]
        assert re.search(r"csrftoken=[^;]+;.*\bSecure\b", page.headers["set-cookie"])

        # and logging in sets a session cookie that is HTTPS-only too
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
        # (the proxy speaks HTTPS to the browser, HTTP to us: send the Secure cookie ourselves)
        cookie = f"csrftoken={page.cookies['csrftoken']}"
        origin = f"https://{page.url.netloc.decode()}"
        login = browser.post("/console/login/", headers={"Origin": origin, "Cookie": cookie}, data={
            "csrfmiddlewaretoken": token, "username": "ops@example.com",
            "password": "correct horse battery"})
        assert login.status_code == 302, login.text
        assert re.search(r"sessionid=[^;]+;.*\bSecure\b", login.headers["set-cookie"])

    # and a plain-HTTP request gets no HSTS (browsers ignore it there; the proxy redirects)
    assert "strict-transport-security" not in httpx.get(f"{base}/console/login/").headers
    # and the console's stylesheet and script (what the CSP allows) are served without DEBUG
    for asset in re.findall(r'(?:href|src)="(/static/console/[^"]+)"', page.text):
        assert httpx.get(f"{base}{asset}").status_code == 200, asset
    assert "/static/console/console.js" in page.text
    # and a request for another host name is refused
    assert httpx.get(f"{base}/console/login/", headers={"Host": "evil.example"}).status_code == 400
