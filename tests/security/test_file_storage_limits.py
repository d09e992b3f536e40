"""Hostile tenants against /v1/files storage, through the official openai SDK and a live
gateway: one organization cannot store more files or bytes than its quota (deleting frees the
room, other organizations keep theirs), a refused upload leaves nothing behind on the disk,
staff can give one organization a quota of its own, and a disk short of free space refuses
new files with a retryable 503 before PostgreSQL and the usage spool run out of room.
"""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from billing_platform.gateway.models import StoredFile
from tests.factories import OrganizationFactory, ProjectFactory, make_key
from tests.gateway.conftest import LiveGateway, start_gateway, stop_gateway


@pytest.fixture
def files_gateway(transactional_db, tmp_path, metering_stream
                  ) -> Iterator[Callable[..., LiveGateway]]:
    """Start a live gateway storing files under this test's directory, with extra settings."""
    started: list[LiveGateway] = []

    def start(**env: str) -> LiveGateway:
        gateway = start_gateway(tmp_path, env={**metering_stream,
                                               "TOLLGATE_FILES_DIR": str(tmp_path / "files"),
                                               **env})
        started.append(gateway)
        return gateway

    yield start
    for gateway in started:
        stop_gateway(gateway)


def _tenant(gateway: LiveGateway, **org_fields) -> tuple[openai.OpenAI, object]:
    org = OrganizationFactory(**org_fields)
    _key, secret = make_key(project=ProjectFactory(organization=org), scopes=["batch"])
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=secret, max_retries=0), org


def _jsonl(size: int) -> bytes:
    """A JSONL batch file of about ``size`` bytes (one request line)."""
    line = {"custom_id": "r", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "small", "messages": [{"role": "user", "content": ""}]}}
    pad = size - len(json.dumps(line)) - 1
    line["body"]["messages"][0]["content"] = "x" * max(pad, 0)
    return json.dumps(line).encode() + b"\n"


def _upload(client: openai.OpenAI, content: bytes):
    return client.files.create(file=("batch.jsonl", io.BytesIO(content)), purpose="batch")


def _on_disk(tmp_path: Path, org) -> int:
    directory = tmp_path / "files" / org.public_id
    return len(list(directory.iterdir())) if directory.exists() else 0


def _refused(exc: openai.APIStatusError, status: int, code: str) -> dict:
    assert exc.status_code == status
    error = exc.response.json()["error"]
    assert error["code"] == code
    return error


def test_an_organization_cannot_store_more_files_than_its_quota(files_gateway, tmp_path):
    # given a quota of 3 files per organization, and two tenants
    gateway = files_gateway(TOLLGATE_ORG_MAX_STORED_FILES="3")
    greedy, greedy_org = _tenant(gateway)
    other, other_org = _tenant(gateway)
    kept = [_upload(greedy, _jsonl(200)) for _ in range(3)]

    # when the greedy one uploads a 4th file
    with pytest.raises(openai.BadRequestError) as refused:
        _upload(greedy, _jsonl(200))

    # then it is refused in OpenAI's shape, saying what to do, and nothing of it is stored
    error = _refused(refused.value, 400, "file_storage_limit_exceeded")
    assert error["param"] == "file" and "limit is 3" in error["message"]
    assert "DELETE /v1/files" in error["message"]
    assert StoredFile.objects.filter(organization=greedy_org).count() == 3
    assert _on_disk(tmp_path, greedy_org) == 3
    # and the other tenant's quota is its own
    assert _upload(other, _jsonl(200)).bytes == 200
    assert _on_disk(tmp_path, other_org) == 1

    # when the greedy one deletes a file, it may upload one again (and only one)
    greedy.files.delete(kept[0].id)
    assert _upload(greedy, _jsonl(200)).bytes == 200
    with pytest.raises(openai.BadRequestError):
        _upload(greedy, _jsonl(200))


def test_an_organization_cannot_store_more_bytes_than_its_quota(files_gateway, tmp_path):
    # given a quota of 2,000 bytes per organization, 1,500 of them used
    gateway = files_gateway(TOLLGATE_ORG_MAX_STORED_BYTES="2000")
    client, org = _tenant(gateway)
    first = _upload(client, _jsonl(1500))

    # when it uploads 1,000 bytes more, then 500
    with pytest.raises(openai.BadRequestError) as refused:
        _upload(client, _jsonl(1000))
    fits = _upload(client, _jsonl(500))

    # then the first is refused (its bytes deleted from the disk), the second fits exactly
    error = _refused(refused.value, 400, "file_storage_limit_exceeded")
    assert "over its limit of 2000" in error["message"]
    assert fits.bytes == 500 and _on_disk(tmp_path, org) == 2
    assert {f.id for f in client.files.list()} == {first.id, fits.id}


def test_staff_can_give_one_organization_a_quota_of_its_own(files_gateway):
    # given a default of 1 file, and an organization staff allowed 3
    gateway = files_gateway(TOLLGATE_ORG_MAX_STORED_FILES="1")
    bigger, _org = _tenant(gateway, max_stored_files=3)
    default, _org = _tenant(gateway)

    # when both upload 3 files
    bigger_ok = [_upload(bigger, _jsonl(100)) for _ in range(3)]
    _upload(default, _jsonl(100))
    with pytest.raises(openai.BadRequestError):
        _upload(default, _jsonl(100))

    # then the organization's own limit applies to it, the default to the other
    assert len(bigger_ok) == 3
    with pytest.raises(openai.BadRequestError):
        _upload(bigger, _jsonl(100))


def test_a_disk_short_of_its_reserve_refuses_new_files_before_writing(files_gateway, tmp_path):
    # given a reserve of free space larger than what the disk has free now
    (tmp_path / "files").mkdir()
    reserve = shutil.disk_usage(tmp_path / "files").free + 1024**3
    gateway = files_gateway(TOLLGATE_FILES_DISK_RESERVE_BYTES=str(reserve))
    client, org = _tenant(gateway)

    # when a tenant uploads a file
    with pytest.raises(openai.InternalServerError) as refused:
        _upload(client, _jsonl(200))

    # then it gets a retryable 503 that says why, and nothing was written or recorded
    error = _refused(refused.value, 503, "insufficient_storage")
    assert "short of storage" in error["message"]
    assert refused.value.response.headers["retry-after"] == "60"
    assert str(reserve) not in error["message"]  # the host's disk figures stay in the log
    assert StoredFile.objects.filter(organization=org).count() == 0
    assert _on_disk(tmp_path, org) == 0
    assert "refusing a file upload" in gateway.log()
