"""One request pipeline: a /v1 request and a batch line are placed by the same rule, so a
residency narrowing that leaves no region serving the model refuses both the same way (the
runner used to narrow to an empty set and leave the batch ``in_progress`` until it expired).
"""

from __future__ import annotations

import openai
import pytest

from billing_platform.gateway.batch import services as batch_services
from billing_platform.gateway.models import Batch, BatchLine
from plans import limits
from tests.factories import OrganizationFactory, ProjectFactory, make_key
from tests.gateway.test_batch_api import MODEL, fast_stack, request_line, upload


@pytest.fixture
def stack(transactional_db, tmp_path, settings, metering_stream):
    yield from fast_stack(tmp_path, settings, metering_stream)


def test_a_key_narrowed_away_from_the_model_is_refused_on_v1_and_in_a_batch(stack):
    # given a key narrowed to eu-west, where no engine of the model runs (they are in us-east)
    org = OrganizationFactory()
    key, secret = make_key(project=ProjectFactory(organization=org),
                           scopes=["inference", "batch"])
    limits.quota_limit_set(organization=org, api_key=key, allowed_regions=["eu-west"])
    client = openai.OpenAI(base_url=f"{stack.gateway.url}/v1", api_key=secret, max_retries=0)

    # when it asks /v1, then the model is not found for it
    with pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(model=MODEL, max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    assert refused.value.response.json()["error"]["code"] == "model_not_found"

    # when it sends the same request as a batch, then the batch fails validation in the same
    # words, and no line is left waiting for an engine it may never use
    created = client.batches.create(input_file_id=upload(client, [request_line(0)]),
                                    endpoint="/v1/chat/completions", completion_window="24h")
    batch_services.batch_validate(batch_id=Batch.objects.get(public_id=created.id).pk)
    failed = client.batches.retrieve(created.id)
    assert failed.status == "failed"
    assert [(e.code, e.message) for e in failed.errors.data] == [
        ("model_not_found", refused.value.response.json()["error"]["message"])]
    assert not BatchLine.objects.filter(batch__public_id=created.id).exists()

    # and a key of the same organization that may run there is served, as a batch too
    _key, allowed = make_key(project=ProjectFactory(organization=org),
                             scopes=["inference", "batch"])
    other = openai.OpenAI(base_url=f"{stack.gateway.url}/v1", api_key=allowed, max_retries=0)
    assert other.chat.completions.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]).choices
    ok = other.batches.create(input_file_id=upload(other, [request_line(0)]),
                              endpoint="/v1/chat/completions", completion_window="24h")
    assert batch_services.batch_validate(
        batch_id=Batch.objects.get(public_id=ok.id).pk).status == "in_progress"
