"""Domain errors under /v1: services raise ``billing_platform.errors``, and /v1 answers every one
of them in OpenAI's shape with OpenAI's status, in one place (``gateway/errors.py``), so the
official SDK raises its typed error and nothing a service refuses is a 500.
"""

from __future__ import annotations

import importlib
import json

import httpx
import openai
import pytest

from billing_platform.api.errors import exception_handler
from billing_platform.errors import DomainError
from billing_platform.gateway.batch import services as batch_services
from billing_platform.gateway.errors import openai_error
from billing_platform.gateway.models import Batch
from tests.gateway.test_batch_api import request_line, upload


def _error(exc: openai.APIStatusError) -> dict:
    return exc.response.json()["error"]


def test_another_orgs_and_forged_ids_are_openai_404s(stack):
    # given a batch and its file in one organization
    mine, other = stack.client(), stack.client()
    file_id = upload(mine, [request_line(0)])
    batch = mine.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                completion_window="24h")

    # when another organization (or anyone, with a forged id) asks for them
    for call, code, param in [
        (lambda: other.files.retrieve(file_id), "file_not_found", "id"),
        (lambda: other.files.content(file_id), "file_not_found", "id"),
        (lambda: other.batches.retrieve(batch.id), "batch_not_found", "batch_id"),
        (lambda: other.batches.cancel(batch.id), "batch_not_found", "batch_id"),
        (lambda: mine.batches.retrieve("batch_" + "0" * 24), "batch_not_found", "batch_id"),
    ]:
        with pytest.raises(openai.NotFoundError) as refused:
            call()
        # then the service's NotFound is OpenAI's 404, and says nothing of the owner
        assert _error(refused.value) == {
            "message": _error(refused.value)["message"], "type": "invalid_request_error",
            "param": param, "code": code}
        assert refused.value.response.headers["x-request-id"].startswith("req_")
    assert mine.batches.retrieve(batch.id).id == batch.id


def test_a_conflict_is_an_openai_409(stack):
    # given a batch that failed validation (its model does not exist)
    client = stack.client()
    created = client.batches.create(
        input_file_id=upload(client, [request_line(0, model="no-such-model")]),
        endpoint="/v1/chat/completions", completion_window="24h")
    batch_services.batch_validate(batch_id=Batch.objects.get(public_id=created.id).pk)
    assert client.batches.retrieve(created.id).status == "failed"

    # when the client cancels it, then the service's Conflict is OpenAI's 409
    with pytest.raises(openai.ConflictError) as refused:
        client.batches.cancel(created.id)
    assert _error(refused.value)["code"] == "batch_not_cancellable"
    assert _error(refused.value)["type"] == "invalid_request_error"


def test_invalid_requests_forbidden_keys_and_missing_keys_keep_openais_shape(stack):
    client = stack.client()
    # an invalid request: 400, a specific code passed on, a plain one null (as OpenAI)
    with pytest.raises(openai.BadRequestError) as unknown:
        client.chat.completions.create(model="small", messages=[{"role": "user",
                                                                 "content": "hi"}],
                                       extra_body={"session_params": {"id": "x"}})
    assert _error(unknown.value) == {"message": "Unknown parameter: 'session_params'.",
                                     "type": "invalid_request_error",
                                     "param": "session_params", "code": "unknown_parameter"}
    with pytest.raises(openai.BadRequestError) as limit:
        client.batches.list(limit=1000)
    assert _error(limit.value)["param"] == "limit" and _error(limit.value)["code"] is None
    # a key without the scope: 403; no key: 401
    with pytest.raises(openai.PermissionDeniedError) as scope:
        stack.client(scopes=("inference",)).batches.list()
    assert _error(scope.value)["code"] == "insufficient_scope"
    anonymous = httpx.get(f"{stack.gateway.url}/v1/batches", timeout=10)
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["code"] == "missing_api_key"


def _every_domain_error() -> list[type[DomainError]]:
    # the apps' own error classes, wherever they are declared
    for module in ("billing_platform.accounts.services", "billing_platform.gateway.errors",
                   "billing_platform.invoicing.services", "metering.services", "plans.admission"):
        importlib.import_module(module)
    found, todo = [], [DomainError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


@pytest.mark.parametrize("cls", _every_domain_error(), ids=lambda cls: cls.__qualname__)
def test_every_domain_error_has_one_answer_on_v1_and_on_api(cls):
    # given any domain error a service may raise
    try:
        exc = cls("It said no.")
    except TypeError:  # a class whose code is required (QuotaExceeded)
        exc = cls("It said no.", code=cls.code)

    # when /v1 answers it, then it is OpenAI's shape at the error's own status
    response = openai_error(exc, "req_x")
    body = json.loads(response.content)
    assert response.status_code == exc.status and 400 <= exc.status < 600
    assert set(body) == {"error"} and body["error"]["message"] == "It said no."
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == ("rate_limit_error" if exc.status == 429 else
                                     "server_error" if exc.status >= 500 else
                                     "invalid_request_error")
    assert response["x-request-id"] == "req_x"

    # and /api answers it in DRF's shape at the same status
    drf = exception_handler(exc, {})
    assert drf is not None and drf.status_code == exc.status
    assert drf.data["detail"] == "It said no." and drf.data["code"] == exc.code


@pytest.fixture
def stack(transactional_db, tmp_path, settings, metering_stream):
    from tests.gateway.test_batch_api import fast_stack

    yield from fast_stack(tmp_path, settings, metering_stream)
