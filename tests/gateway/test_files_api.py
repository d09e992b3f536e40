"""/v1/files through the official openai SDK: upload, list, retrieve, content, delete, org scope."""

from __future__ import annotations

import io
import json

import openai
import pytest

from tests.factories import OrganizationFactory, ProjectFactory, make_key
from tests.gateway.conftest import start_gateway, stop_gateway


@pytest.fixture
def files_gateway(transactional_db, tmp_path, settings, metering_stream):
    settings.FILES_DIR = str(tmp_path / "files")
    gateway = start_gateway(tmp_path, env={**metering_stream,
                                           "TOLLGATE_FILES_DIR": settings.FILES_DIR})
    yield gateway
    stop_gateway(gateway)


def _client(gateway, scopes=("inference", "batch")) -> openai.OpenAI:
    org = OrganizationFactory()
    _key, secret = make_key(project=ProjectFactory(organization=org), scopes=list(scopes))
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=secret, max_retries=0)


def _jsonl(n: int) -> bytes:
    return b"".join(json.dumps({"custom_id": f"r{i}", "method": "POST",
                                "url": "/v1/chat/completions",
                                "body": {"model": "small", "messages": [
                                    {"role": "user", "content": f"hi {i}"}]}}).encode() + b"\n"
                    for i in range(n))


def test_upload_list_retrieve_content_delete(files_gateway):
    client = _client(files_gateway)
    content = _jsonl(3)
    uploaded = client.files.create(file=("requests.jsonl", io.BytesIO(content)),
                                   purpose="batch")
    assert uploaded.id.startswith("file-") and uploaded.bytes == len(content)
    assert uploaded.purpose == "batch" and uploaded.filename == "requests.jsonl"

    second = client.files.create(file=("more.jsonl", io.BytesIO(_jsonl(1))), purpose="batch")
    listed = [f.id for f in client.files.list()]
    assert listed == [second.id, uploaded.id]
    page = client.files.list(limit=1)
    assert [f.id for f in page.data] == [second.id] and page.has_more
    assert [f.id for f in client.files.list(limit=1, after=second.id).data] == [uploaded.id]

    assert client.files.retrieve(uploaded.id).bytes == len(content)
    assert client.files.content(uploaded.id).content == content

    deleted = client.files.delete(uploaded.id)
    assert deleted.deleted and deleted.id == uploaded.id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)
    assert [f.id for f in client.files.list()] == [second.id]


def test_another_organizations_file_is_not_found(files_gateway):
    mine, theirs = _client(files_gateway), _client(files_gateway)
    uploaded = mine.files.create(file=("a.jsonl", io.BytesIO(_jsonl(1))), purpose="batch")
    for call in (lambda: theirs.files.retrieve(uploaded.id),
                 lambda: theirs.files.content(uploaded.id),
                 lambda: theirs.files.delete(uploaded.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert list(theirs.files.list()) == []
    assert mine.files.retrieve(uploaded.id).id == uploaded.id


def test_upload_rejects_wrong_purpose_type_and_too_many_lines(files_gateway, settings):
    client = _client(files_gateway)
    with pytest.raises(openai.BadRequestError) as wrong_purpose:
        client.files.create(file=("a.jsonl", io.BytesIO(_jsonl(1))), purpose="fine-tune")
    assert wrong_purpose.value.body["param"] == "purpose"
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("a.csv", io.BytesIO(b"a,b\n")), purpose="batch")
    with pytest.raises(openai.BadRequestError) as too_many:
        client.files.create(file=("big.jsonl", io.BytesIO(b"{}\n" * 50_001)), purpose="batch")
    assert "50000" in too_many.value.message


def test_files_need_the_batch_scope(files_gateway):
    client = _client(files_gateway, scopes=("inference",))
    with pytest.raises(openai.PermissionDeniedError):
        client.files.list()


def test_upload_larger_than_the_json_body_limit(files_gateway):
    # a batch file of ~12 MB: above /v1's 8 MB JSON body limit, within the 200 MB file limit
    client = _client(files_gateway)
    line = json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "small", "messages": [
                           {"role": "user", "content": "y" * 1000}]}}).encode() + b"\n"
    content = line * (12 * 1024 * 1024 // len(line))
    uploaded = client.files.create(file=("big.jsonl", io.BytesIO(content)), purpose="batch")
    assert uploaded.bytes == len(content)
    assert client.files.content(uploaded.id).content == content
