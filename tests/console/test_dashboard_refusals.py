"""The dashboard's 429s by reason: requests a live gateway refused (through the openai SDK)
are counted per organization, hour and reason in Redis and shown on the dashboard; another
organization's refusals never are."""

from __future__ import annotations

import asyncio
import re
from datetime import UTC, datetime, timedelta

import openai

from billing_platform.accounts.choices import Role
from plans import limits, refusals
from tests.factories import MembershipFactory, OrganizationFactory, ProjectFactory, make_key
from tests.gateway.conftest import live_gateway  # noqa: F401 - a fixture

# F811 below: ``live_gateway`` is the fixture imported above, named as a test's argument


def _refused_rows(page: str) -> dict[str, int]:
    table = page[page.index('id="refused"'):]
    table = table[:table.index("</table>")]
    return {label: int(n) for label, n in re.findall(r"<tr><td>([^<]+)</td><td>(\d+)</td>",
                                                     table)}


def test_requests_refused_by_the_rpm_limit_show_on_the_dashboard_by_reason(
        live_gateway, client):  # noqa: F811
    # given an organization limited to 2 requests a minute, and another one
    org = OrganizationFactory()
    _key, secret = make_key(ProjectFactory(organization=org), scopes=["inference"])
    limits.quota_limit_set(organization=org, rpm=2)
    other = OrganizationFactory()
    _other_key, other_secret = make_key(ProjectFactory(organization=other),
                                        scopes=["inference"])
    limits.quota_limit_set(organization=other, rpm=1)
    sdk = openai.OpenAI(base_url=f"{live_gateway.url}/v1", api_key=secret, max_retries=0)
    theirs = openai.OpenAI(base_url=f"{live_gateway.url}/v1", api_key=other_secret,
                           max_retries=0)

    # when it sends 5 requests (2 answered, 3 refused) and the other org 3 (2 refused)
    outcomes = []
    for sender, count in ((sdk, 5), (theirs, 3)):
        for _ in range(count):
            try:
                sender.chat.completions.create(model="small", max_tokens=2, messages=[
                    {"role": "user", "content": "hi"}])
                outcomes.append(200)
            except openai.RateLimitError:
                outcomes.append(429)
    assert outcomes == [200, 200, 429, 429, 429, 200, 429, 429]

    # then its dashboard counts its own 3 refusals under the limit that refused them
    client.force_login(MembershipFactory(organization=org, role=Role.VIEWER).user)
    page = client.get("/console/").content.decode()
    assert _refused_rows(page) == {"Requests per minute limit": 3}
    assert 'id="refused-chart"' in page


def test_refusals_are_summed_over_the_hours_of_the_range(db):
    # given refusals of one org recorded in three hours, one outside the range
    org_id = 987_654
    now = datetime.now(UTC).replace(minute=30)

    async def record() -> None:
        for at, reason in ((now, "rpm"), (now, "rpm"), (now - timedelta(hours=2), "tpm"),
                           (now - timedelta(hours=2), "rpm"), (now - timedelta(hours=30),
                                                              "organization_budget")):
            await refusals.arecord(org_id=org_id, reason=reason, at=at)

    from billing_platform import redis_conn

    asyncio.run(record())
    redis_conn.reset_clients()  # the asyncio client belonged to that loop

    # then the last day's counts are summed by reason, most first
    assert refusals.refusals_by_reason(org_id=org_id, start=now - timedelta(hours=24),
                                       end=now + timedelta(hours=1)) == [("rpm", 3), ("tpm", 1)]
    assert dict(refusals.refusals_by_reason(
        org_id=org_id, start=now - timedelta(hours=48), end=now + timedelta(hours=1))) == {
        "rpm": 3, "tpm": 1, "organization_budget": 1}
    assert refusals.reason_label("organization_budget") == "Organization's hard budget"
