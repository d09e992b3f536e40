"""Console plan advice page: the API's advice for the org's billing readers, a malformed
period as a form message (escaped), other roles sent back to the dashboard."""

from __future__ import annotations

import pytest

from billing_platform.accounts.choices import Role
from tests.factories import MembershipFactory
from tests.plans.test_plan_advisor import october_on_token_plan_o


@pytest.fixture
def token_plan_month(db):
    return october_on_token_plan_o()


def test_an_owner_sees_every_alternative_the_cheapest_and_the_saving(token_plan_month, client):
    # given October closed for an org on token plan O (figures of test_plan_advisor)
    owner = MembershipFactory(organization=token_plan_month, role=Role.OWNER).user
    client.force_login(owner)

    # when its owner opens the page (the last closed period by default)
    page = client.get("/console/plan-advice/").content.decode()

    # then what was billed, each alternative and the recommendation are there
    assert "2026-10-01 00:00 \u2013 2026-11-01 00:00 UTC · 4 requests" in page
    assert "What was billed: <strong>11.73 USD</strong>" in page
    assert ("Cheapest: <strong>On-demand, eligible requests at the batch tier</strong> at "
            "<strong>3.70 USD</strong>, saving <strong>8.03 USD</strong>") in page
    for name, total in (("On-demand", "4.40"), ("Plan O", "11.73"), ("Plan B", "1.00")):
        assert name in page and f"<strong>{total} USD</strong>" in page
    assert "<td>2</td><td>2</td>" in page  # Plan B: 2 served, 2 would have been refused
    assert 'href="/console/plan-advice/"' in page  # in the navigation


def test_a_malformed_period_is_a_form_message_and_other_roles_are_sent_back(
        token_plan_month, client):
    owner = MembershipFactory(organization=token_plan_month, role=Role.OWNER).user
    client.force_login(owner)
    page = client.get("/console/plan-advice/", {"start": "<script>x</script>",
                                                 "end": "2026-11-01T00:00:00Z"})
    assert page.status_code == 200
    body = page.content.decode()
    assert 'class="errorlist"' in body and "start:" in body
    assert "<script>x" not in body and "&lt;script&gt;x" in body
    assert "What was billed" not in body

    developer = MembershipFactory(organization=token_plan_month, role=Role.DEVELOPER).user
    client.force_login(developer)
    reply = client.get("/console/plan-advice/")
    assert reply.status_code == 302 and reply["Location"] == "/console/"
