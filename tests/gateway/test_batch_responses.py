"""Issue 20: ``/v1/responses`` as a Batch API endpoint, through the official ``openai`` SDK
and a live gateway over simulated engines: each line is answered as a Response (the shape
``responses.create`` returns, its usage the line's usage event at the batch tier), stored
unless the line says ``store: false`` (so ``responses.retrieve`` reads it back, and only its
own organization), and a line that cannot run as a batch line (one continuing a stored
response, a stream, a tool) fails the batch at validation with its line and param.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from billing_platform.gateway.models import Batch, BatchLine
from metering.models import UsageEvent
from tests.gateway.conftest import drain_usage
from tests.gateway.test_batch_api import MODEL, BatchStack, fast_stack, run_here


@pytest.fixture
def stack(transactional_db, tmp_path, settings, metering_stream) -> Iterator[BatchStack]:
    yield from fast_stack(tmp_path, settings, metering_stream)


def _line(i: int, **body) -> dict:
    return {"custom_id": f"r-{i}", "method": "POST", "url": "/v1/responses",
            "body": {"model": MODEL, "input": f"Summarise item {i}.",
                     "max_output_tokens": 8, **body}}


def _run(client: openai.OpenAI, lines: list[dict]) -> Batch:
    return run_here(client, lines, "/v1/responses")


def test_response_lines_are_responses_metered_at_the_batch_tier_and_stored(stack):
    client = stack.client()
    lines = [_line(0, instructions="Answer in one word.", metadata={"job": "nightly"}),
             _line(1), _line(2, store=False), _line(3, max_output_tokens=1)]
    batch = _run(client, lines)

    done = {x.custom_id: x.response for x in BatchLine.objects.filter(batch=batch,
                                                                      state="completed")}
    assert sorted(done) == ["r-0", "r-1", "r-2", "r-3"]
    drain_usage()
    events = {e.request_id: e for e in UsageEvent.objects.filter(batch_id=batch.public_id)}
    assert len(events) == 4 and {e.service_tier for e in events.values()} == {"batch"}
    for line in BatchLine.objects.filter(batch=batch):
        body, event = line.response, events[line.request_id]
        # the body is a Response (the SDK's own model reads it), worded as /v1 words it
        response = openai.types.responses.Response.model_validate(body)
        assert response.id == f"resp_{line.request_id[4:]}"
        assert response.output_text == body["output"][0]["content"][0]["text"]
        usage = response.usage
        assert (usage.input_tokens, usage.input_tokens_details.cached_tokens,
                usage.output_tokens, usage.total_tokens) == (
            event.prompt_tokens, event.cached_tokens, event.completion_tokens,
            event.prompt_tokens + event.completion_tokens)
    assert done["r-0"]["instructions"] == "Answer in one word."
    assert done["r-0"]["metadata"] == {"job": "nightly"}
    # the bound the line set is the bound it ran under
    assert done["r-3"]["status"] == "incomplete"
    assert done["r-3"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert done["r-3"]["usage"]["output_tokens"] == 1

    # stored lines read back through the SDK, as answered; store: false ones do not
    stored = client.responses.retrieve(done["r-1"]["id"])
    assert stored.output_text == done["r-1"]["output"][0]["content"][0]["text"]
    assert stored.usage.output_tokens == done["r-1"]["usage"]["output_tokens"]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(done["r-2"]["id"])
    # ...and a stored line continues as any stored response does, in its organization only
    follow = client.responses.create(model=MODEL, input="And then?", max_output_tokens=4,
                                     previous_response_id=done["r-1"]["id"])
    assert follow.usage.input_tokens > done["r-1"]["usage"]["input_tokens"]
    with pytest.raises(openai.NotFoundError):
        stack.client().responses.retrieve(done["r-1"]["id"])


@pytest.mark.parametrize(("body", "param"), [
    ({"previous_response_id": "resp_0123"}, "body.previous_response_id"),
    ({"stream": True}, "body.stream"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "body.tools"),
    ({"input": []}, "body.input"),
    ({"reasoning": {"effort": "high"}}, "body.reasoning"),
])
def test_a_line_that_cannot_run_fails_the_batch_with_its_line_and_param(stack, body, param):
    client = stack.client()
    batch = _run(client, [_line(0), _line(1, **body)])
    assert batch.status == "failed"
    assert [(e["line"], e["param"]) for e in batch.errors] == [(2, param)]
    assert not BatchLine.objects.filter(batch=batch).exists()
    drain_usage()
    assert not UsageEvent.objects.filter(batch_id=batch.public_id).exists()
