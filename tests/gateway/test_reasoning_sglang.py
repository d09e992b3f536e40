"""Issue 20 item 5, reasoning tokens, through the gateway to REAL SGLang on the CPU with a
reasoning parser (``--reasoning-parser deepseek-r1``: a model that thinks first, as R1-style
templates make it), with the official ``openai`` SDK. The tiny random model never closes its
thinking, so every output token is reasoning, as SGLang counts it: the usage the SDK sees
(chat, stream, Responses) carries the engine's ``reasoning_tokens``, and the stored event holds
the same count, billed as output.
"""

from __future__ import annotations

from decimal import Decimal

import pytest

from engine_adapter.sglang_cpu import is_ready
from tests.factories import make_price_book
from tests.gateway.test_openai_api import _event
from tests.real_sglang import gateway_on_real_sglang

pytestmark = pytest.mark.skipif(
    not is_ready(), reason="the SGLang CPU environment is not set up; run "
                           "`python -m engine_adapter.sglang_cpu setup` first")

MODEL = "thinker"
ASK = [{"role": "user", "content": "Think it over."}]


def test_reasoning_tokens_are_the_engines_count_stored_and_billed(transactional_db, tmp_path,
                                                                   metering_stream):
    make_price_book(prices=[{"model": MODEL, "input": "1.00", "output": "2.00"}])
    with gateway_on_real_sglang(tmp_path, metering_stream, model=MODEL,
                                extra_args=("--reasoning-parser", "deepseek-r1")) as client:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=ASK, max_tokens=12, seed=1)
        answer = raw.parse()
        usage = answer.usage
        # the random model may end (EOS) before max_tokens, as it did once on a loaded machine:
        # whatever it produced is all reasoning, counted by the engine and stored as such
        produced = usage.completion_tokens
        assert 1 <= produced <= 12
        assert usage.completion_tokens_details.reasoning_tokens == produced
        # the SDK sees it as SGLang's reasoning, none of it as the answer; its text is there
        # unless the model ended at once (a CI run once saw reasoning_content None: it had
        # produced only its end-of-sequence token)
        choice = answer.choices[0]
        assert not choice.message.content
        assert "reasoning_content" in choice.message.model_extra
        if choice.finish_reason == "length":
            assert choice.message.model_extra["reasoning_content"]
        event = _event(raw.headers["x-request-id"])
        assert (event.completion_tokens, event.reasoning_tokens) == (produced, produced)
        # reasoning is output, priced as output
        assert event.amount == (event.prompt_tokens * Decimal("1.00")
                                + produced * Decimal("2.00")) / 1_000_000

        with client.chat.completions.with_streaming_response.create(
                model=MODEL, messages=ASK, max_tokens=8, stream=True, seed=2,
                stream_options={"include_usage": True}) as response:
            chunks = list(response.parse())
        final = chunks[-1].usage
        # all of it reasoning, the engine's count, stored as such (this prompt is a prefix-cache
        # hit; on a loaded machine the random model once ended after 2 of the 8 tokens)
        assert 1 <= final.completion_tokens <= 8
        assert final.completion_tokens_details.reasoning_tokens == final.completion_tokens
        assert _event(response.headers["x-request-id"]).reasoning_tokens == (
            final.completion_tokens)

        replied = client.responses.with_raw_response.create(model=MODEL, input="Think.",
                                                            max_output_tokens=6)
        replied_usage = replied.parse().usage
        assert 1 <= replied_usage.output_tokens <= 6
        assert replied_usage.output_tokens_details.reasoning_tokens == replied_usage.output_tokens
        assert _event(replied.headers["x-request-id"]).reasoning_tokens == (
            replied_usage.output_tokens)
