"""Console batches page: a member sees the organization's batches with their progress,
downloads their files, and cancels a running one; roles and organizations are kept apart.

Batches are created through the official openai SDK against a live gateway and run here by
the batch runner on simulated engines, so the page shows what the API produced.
"""

from __future__ import annotations

import json

import openai
import pytest

from billing_platform.accounts.choices import Role
from billing_platform.gateway.batch import runner
from billing_platform.gateway.batch import services as batch_services
from billing_platform.gateway.models import Batch
from tests.factories import MembershipFactory, ProjectFactory, make_key
from tests.gateway.test_batch_api import fast_stack, request_line, upload


@pytest.fixture
def stack(transactional_db, tmp_path, settings, metering_stream):
    yield from fast_stack(tmp_path, settings, metering_stream)


def _batch(client: openai.OpenAI, lines: int) -> Batch:
    """Create a batch through the SDK and validate it here: it is then in_progress."""
    created = client.batches.create(
        input_file_id=upload(client, [request_line(i) for i in range(lines)]),
        endpoint="/v1/chat/completions", completion_window="24h",
        metadata={"job": "nightly"})
    return batch_services.batch_validate(batch_id=Batch.objects.get(public_id=created.id).pk)


def _run_to_the_end(batch: Batch) -> None:
    for _ in range(30):
        if runner.batch_run(batch_id=batch.pk, slice_s=1.0) == "drained":
            break
    batch.refresh_from_db()
    assert batch.status == "completed"


def test_batches_page_shows_progress_files_and_cancels(stack, client):
    # given an organization with a console member and an API key
    owner = MembershipFactory()
    org = owner.organization
    _key, secret = make_key(project=ProjectFactory(organization=org, name="Research"),
                            scopes=["inference", "batch"])
    sdk = openai.OpenAI(base_url=f"{stack.gateway.url}/v1", api_key=secret, max_retries=0)
    # and one batch run to the end, and one still waiting to run
    done = _batch(sdk, 6)
    _run_to_the_end(done)
    waiting = _batch(sdk, 4)
    # and another organization's batch
    elsewhere = _batch(stack.client(), 2)
    client.force_login(owner.user)

    # when the member opens the batches page
    page = client.get("/console/batches/").content.decode()

    # then both batches show with their status and counts, the other org's not at all
    assert done.public_id in page and waiting.public_id in page
    assert elsewhere.public_id not in page
    assert "6 completed, 0 failed of 6" in page and "0 completed, 0 failed of 4" in page
    assert "Research" in page
    assert page.count(">Cancel</button>") == 1  # only the running batch can be cancelled

    # when the member downloads the finished batch's output file from the page
    done.refresh_from_db()
    link = f"/console/files/{done.output_file.public_id}/"
    assert link in page
    response = client.get(link)
    # then it is the same JSONL the API serves: one result per request, by custom_id
    assert response["Content-Disposition"].startswith("attachment")
    rows = [json.loads(line) for line in b"".join(response.streaming_content).splitlines()]
    assert sorted(r["custom_id"] for r in rows) == sorted(f"req-{i}" for i in range(6))
    assert all(r["response"]["status_code"] == 200 for r in rows)
    assert [json.loads(line)["custom_id"] for line in sdk.files.content(
        done.output_file.public_id).text.splitlines()] == [r["custom_id"] for r in rows]

    # when a viewer tries to cancel the running batch
    viewer = MembershipFactory(organization=org, role=Role.VIEWER)
    client.force_login(viewer.user)
    assert ">Cancel</button>" not in client.get("/console/batches/").content.decode()
    refused = client.post(f"/console/batches/{waiting.public_id}/cancel/", follow=True)
    # then it is refused with a message and the batch runs on
    assert "cannot do that" in refused.content.decode()
    assert sdk.batches.retrieve(waiting.public_id).status == "in_progress"

    # when the owner cancels it from the page
    client.force_login(owner.user)
    cancelled = client.post(f"/console/batches/{waiting.public_id}/cancel/", follow=True)
    # then the API reports it cancelled, with its unrun lines dropped, and the page says so
    assert "is cancelled" in cancelled.content.decode()
    assert sdk.batches.retrieve(waiting.public_id).status == "cancelled"
    again = client.post(f"/console/batches/{waiting.public_id}/cancel/", follow=True)
    assert again.status_code == 200  # cancelling twice is harmless

    # and another organization's batch and files are not found from this console
    assert client.post(f"/console/batches/{elsewhere.public_id}/cancel/").status_code == 404
    elsewhere.refresh_from_db()
    assert client.get(f"/console/files/{elsewhere.input_file.public_id}/").status_code == 404
    assert elsewhere.status == "in_progress"
