"""Real SGLang serving the tiny model as an embedding model (``--is-embedding``) on this CPU,
side by side with the simulator launched with the same flags: the same answers on the wire
the gateway relays (shapes, usage, base64, ``dimensions``, errors, per-input request ids),
and the official ``openai`` SDK reading both.

What the gateway and the fleet rely on, each found on real SGLang 0.5: an embeddings body
with a list of inputs takes only a list of request ids (a single string fails it with a 500);
the answer names the model's path, not its served name; and a generation request fails an
embedding engine's scheduler outright (the gateway never sends one: each model answers only
its own endpoints).
"""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Iterator

import httpx
import openai
import pytest

from engine_adapter.sglang_cpu import is_ready
from tests.real_sglang import side_by_side

pytestmark = pytest.mark.skipif(
    not is_ready(), reason="run `python -m engine_adapter.sglang_cpu setup` first")

MODEL = "tiny-embed"
DIM = 64  # the tiny model's hidden size
FLAGS = ["--is-embedding", "--json-model-override-args", '{"is_matryoshka": true}']


@pytest.fixture(autouse=True)
def _clean_redis() -> None:
    """Override the root conftest's Redis cleanup: these tests touch neither Redis nor the DB."""


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Iterator[dict[str, str]]:
    with side_by_side(tmp_path_factory.mktemp("sglang-embed"), model=MODEL, extra_args=FLAGS,
                      is_embedding=True, json_model_override_args=FLAGS[2]) as urls:
        yield urls


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", json={"model": MODEL, **body}, timeout=120)


def _norm(vector) -> float:
    return math.sqrt(math.fsum(x * x for x in vector))


def _floats(b64: str) -> list[float]:
    raw = base64.b64decode(b64)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


KINDS = ["sglang", "sim"]


@pytest.mark.parametrize("kind", KINDS)
def test_same_answer_shape_and_usage(engines, kind):
    r = _post(engines[kind], {"input": ["the ledger", "keeps every token"],
                              "rid": ["r-1-0", "r-1-1"], "priority": 0, "cache_salt": "t"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert {"data", "model", "object", "usage"} <= body.keys() and body["object"] == "list"
    assert [(d["object"], d["index"], len(d["embedding"])) for d in body["data"]] == [
        ("embedding", 0, DIM), ("embedding", 1, DIM)]
    # bf16 on the real engine: normalized to within its precision
    assert all(abs(_norm(d["embedding"]) - 1) < 0.01 for d in body["data"])
    usage = body["usage"]
    assert usage["prompt_tokens"] > 0 and usage["total_tokens"] == usage["prompt_tokens"]
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens_details"] is None
    assert body["model"] != MODEL  # the model's path, not the served name


@pytest.mark.parametrize("kind", KINDS)
def test_same_base64_and_dimensions(engines, kind):
    url = engines[kind]
    floats = _post(url, {"input": "hello world"}).json()["data"][0]["embedding"]
    packed = _post(url, {"input": "hello world", "encoding_format": "base64"}).json()
    assert all(abs(a - b) < 1e-6 for a, b in zip(_floats(packed["data"][0]["embedding"]),
                                                 floats, strict=True))
    short = _post(url, {"input": "hello world", "dimensions": 16}).json()
    vector = short["data"][0]["embedding"]
    assert len(vector) == 16 and abs(_norm(vector) - 1) < 0.01


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("body", "status", "says"), [
    ({"input": ""}, 400, "Input cannot be empty"),
    ({"input": ["ok", " "]}, 400, "Input at index 1 cannot be empty"),
    ({"input": "x", "encoding_format": "hex"}, 400, "encoding_format must be either"),
    ({"input": "x", "dimensions": DIM + 1}, 400, "greater than max embedding dimension"),
    ({"input": ["a list"], "rid": "one-string"}, 500, "The rid should be a list"),
])
def test_same_refusals(engines, kind, body, status, says):
    r = _post(engines[kind], body)
    assert r.status_code == status
    error = r.json()
    assert error["object"] == "error" and error["code"] == status and says in error["message"]


@pytest.mark.parametrize("kind", KINDS)
def test_token_id_arrays_count_as_their_length(engines, kind):
    r = _post(engines[kind], {"input": [[5, 6, 7], [8]], "rid": ["t-0", "t-1"]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 4


@pytest.mark.parametrize("kind", KINDS)
def test_the_openai_sdk_reads_both(engines, kind):
    client = openai.OpenAI(base_url=f"{engines[kind]}/v1", api_key="none", max_retries=0)
    answer = client.embeddings.create(model=MODEL, input=["one", "two", "three"],
                                      extra_body={"rid": ["s-0", "s-1", "s-2"]})
    assert [len(d.embedding) for d in answer.data] == [DIM] * 3
    assert answer.usage.prompt_tokens > 0
