"""SGLang's ``/v1/tokenize``, which Anthropic's ``count_tokens`` is answered from, on real
SGLang (the tiny model on this CPU) side by side with the simulator: the same shape (``tokens``,
``count``, ``max_model_len``), chat ``messages`` counted through the chat template exactly as a
chat completion's ``prompt_tokens`` (so a count is what a create call will be billed for),
prompts as a string or a list, and a bad prompt refused with a 400.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from engine_adapter.sglang_cpu import is_ready
from tests.real_sglang import side_by_side

pytestmark = pytest.mark.skipif(
    not is_ready(), reason="run `python -m engine_adapter.sglang_cpu setup` first")

MODEL = "tiny"
KINDS = ["sglang", "sim"]
TURNS = [{"role": "system", "content": "You are terse."},
         {"role": "user", "content": "Say hi"},
         {"role": "assistant", "content": "Hi."},
         {"role": "user", "content": "And again, at more length please."}]


@pytest.fixture(autouse=True)
def _clean_redis() -> None:
    """Override the root conftest's Redis cleanup: these tests touch neither Redis nor the DB."""


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Iterator[dict[str, str]]:
    with side_by_side(tmp_path_factory.mktemp("sglang-tokenize"), model=MODEL) as urls:
        yield urls


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": MODEL, **body}, timeout=120)


@pytest.mark.parametrize("kind", KINDS)
def test_messages_count_as_the_chat_completion_prefills_them(engines, kind):
    url = engines[kind]
    counted = _post(url, "/v1/tokenize", {"messages": TURNS})
    assert counted.status_code == 200, counted.text
    body = counted.json()
    assert set(body) == {"tokens", "count", "max_model_len"}
    assert body["count"] == len(body["tokens"]) > 0
    assert all(isinstance(t, int) for t in body["tokens"]) and body["max_model_len"] > 0
    for turns in (TURNS, TURNS[1:2]):
        chat = _post(url, "/v1/chat/completions", {"messages": turns, "max_tokens": 1})
        assert chat.status_code == 200, chat.text
        count = _post(url, "/v1/tokenize", {"messages": turns}).json()["count"]
        assert count == chat.json()["usage"]["prompt_tokens"]
    # the old path answers the same
    assert _post(url, "/tokenize", {"messages": TURNS}).json()["count"] == body["count"]


@pytest.mark.parametrize("kind", KINDS)
def test_prompts_as_a_string_or_a_list_and_a_bad_prompt(engines, kind):
    url = engines[kind]
    one = _post(url, "/v1/tokenize", {"prompt": "Say hi to everyone"}).json()
    assert one["count"] == len(one["tokens"]) > 0
    several = _post(url, "/v1/tokenize", {"prompt": ["Say hi", "to everyone here"]}).json()
    assert isinstance(several["count"], list) and len(several["count"]) == 2
    assert several["count"] == [len(ids) for ids in several["tokens"]]
    bad = _post(url, "/v1/tokenize", {"prompt": 7})
    assert bad.status_code == 400
