"""Real SGLang, on this CPU, does what the platform bills and routes by.

The engine adapter, the simulator's conformance test and the demo all assume facts about
SGLang's HTTP surface: usage with cached tokens, a final usage chunk when streaming, prefix-cache
isolation by ``cache_salt``, priority ordering, abort on disconnect, the admin endpoints. These
tests start one real server (built by ``python -m engine_adapter.sglang_cpu setup``) with
``--max-running-requests 1`` so queueing is observable, and check each fact over HTTP, through
the official ``openai`` SDK where a customer would use it.

The model has random weights, so requests that need a known length pass ``ignore_eos``.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from engine_adapter.sglang_cpu import is_ready, resolve_paths
from tests.real_sglang import real_sglang

MODEL = "tiny-llama"
STARTUP_TIMEOUT_S = 120.0

pytestmark = pytest.mark.skipif(
    not is_ready(),
    reason=(
        "the SGLang CPU environment is not set up; run "
        "`python -m engine_adapter.sglang_cpu setup` first"
    ),
)


@pytest.fixture(autouse=True)
def _clean_redis() -> None:
    """Override the root conftest's Redis cleanup: these tests touch neither Redis nor the DB."""


@dataclass(frozen=True)
class Engine:
    base_url: str
    log_file: Path

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"{self.base_url}{path}", timeout=60.0)

    def post(self, path: str) -> httpx.Response:
        return httpx.post(f"{self.base_url}{path}", timeout=60.0)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0)

    def metric(self, name: str, default: float | None = None) -> float:
        """Return the sum over label sets of one ``sglang:`` metric (``default`` if absent)."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        pattern = re.compile(rf"^sglang:{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", re.MULTILINE)
        values = [float(v) for v in pattern.findall(text)]
        if not values and default is not None:
            return default
        assert values, f"metric sglang:{name} not exported"
        return sum(values)

    def load(self) -> dict[str, int]:
        """Return the scheduler's load (``/v1/loads``: fresher than the gauges in /metrics)."""
        return httpx.get(f"{self.base_url}/v1/loads", timeout=10).json()["loads"][0]

    def wait_for_load(self, key: str, predicate: Callable[[int], bool], timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while not predicate(value := self.load()[key]):
            if time.monotonic() > deadline:
                pytest.fail(f"{key} stayed at {value} for {timeout}s")
            time.sleep(0.05)
        return value


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    log_file = tmp_path_factory.mktemp("sglang") / "server.log"
    with real_sglang(log_file, served_model_name=MODEL, timeout=STARTUP_TIMEOUT_S,
                     extra_args=("--max-running-requests", "1")) as base_url:
        yield Engine(base_url=base_url, log_file=log_file)


def _long_prompt(words: int = 360) -> str:
    """Return a unique English prompt of roughly 500 tokens with this tokenizer."""
    base = "the meter counts every token that the engine reads and writes for each customer "
    text = (base * (words // len(base.split()) + 1)).split()[:words]
    return f"request {uuid.uuid4().hex}: " + " ".join(text)


# -- OpenAI-compatible surface, through the official SDK --------------------------------------


def test_chat_completion_reports_usage(engine: Engine) -> None:
    client = engine.openai()

    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "How many tokens did I use?"}],
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )

    assert reply.model == MODEL
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 8
    assert reply.usage.prompt_tokens > 5
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 8


def test_completion_reports_usage(engine: Engine) -> None:
    reply = engine.openai().completions.create(
        model=MODEL, prompt="def meter(tokens):", max_tokens=6, extra_body={"ignore_eos": True}
    )

    assert reply.choices[0].text
    assert reply.usage.completion_tokens == 6
    assert reply.usage.prompt_tokens > 0


@pytest.mark.parametrize("api", ["chat", "completion"])
def test_stream_ends_with_a_usage_only_chunk(engine: Engine, api: str) -> None:
    client = engine.openai()
    common = {
        "model": MODEL,
        "max_tokens": 7,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": {"ignore_eos": True},
    }
    if api == "chat":
        stream = client.chat.completions.create(
            messages=[{"role": "user", "content": "stream please"}], **common
        )
    else:
        stream = client.completions.create(prompt="stream please", **common)

    chunks = list(stream)

    *content_chunks, last = chunks
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.completion_tokens == 7
    assert all(chunk.usage is None for chunk in content_chunks)
    assert any(chunk.choices for chunk in content_chunks)


def test_models_lists_the_served_name(engine: Engine) -> None:
    assert [m.id for m in engine.openai().models.list()] == [MODEL]


# -- prefix cache: what discounted "cached input" billing relies on ---------------------------


def test_repeated_long_prompt_reports_cached_tokens(engine: Engine) -> None:
    client = engine.openai()
    prompt = _long_prompt()

    def cached_tokens() -> tuple[int, int]:
        usage = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1).usage
        return usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens

    prompt_tokens, first = cached_tokens()
    _, second = cached_tokens()

    assert prompt_tokens >= 400
    assert first == 0
    assert second >= prompt_tokens - 16  # all but the last (partial) page of the prompt


def test_flush_cache_forgets_cached_prefixes(engine: Engine) -> None:
    client = engine.openai()
    prompt = _long_prompt()
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)

    response = engine.post("/flush_cache")
    usage = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1).usage

    assert response.status_code == 200
    assert usage.prompt_tokens_details.cached_tokens == 0


def test_cache_salt_isolates_tenants(engine: Engine) -> None:
    client = engine.openai()
    messages = [{"role": "user", "content": _long_prompt()}]

    def cached_tokens(salt: str) -> int:
        usage = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=1, extra_body={"cache_salt": salt}
        ).usage
        return usage.prompt_tokens_details.cached_tokens

    org_a_first = cached_tokens("org-a")
    org_b_first = cached_tokens("org-b")
    org_a_again = cached_tokens("org-a")
    org_b_again = cached_tokens("org-b")

    assert org_a_first == 0
    assert org_b_first == 0  # same prompt, other tenant: no hit on org-a's cache
    assert org_a_again > 400
    assert org_b_again > 400


# -- scheduling ---------------------------------------------------------------------------


def test_higher_priority_starts_ahead_of_queued_lower_priority(engine: Engine) -> None:
    # given one long request running (the server runs one at a time) ...
    finished_at: dict[str, float] = {}
    errors: list[BaseException] = []

    def send(name: str, priority: int, max_tokens: int) -> threading.Thread:
        def run() -> None:
            try:
                # SGLang's native route: its meta_info says when the engine itself finished
                # each request, so the order below is the engine's and not the order in
                # which three client threads got the GIL back on a loaded machine
                resp = httpx.post(f"{engine.base_url}/generate", timeout=120, json={
                    "text": f"{name} {uuid.uuid4().hex}",
                    "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True},
                    "priority": priority,
                })
                resp.raise_for_status()
                finished_at[name] = resp.json()["meta_info"]["response_sent_to_client_ts"]
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    threads = [send("long", priority=0, max_tokens=600)]
    engine.wait_for_load("num_running_reqs", lambda v: v == 1, timeout=30)
    # ... and a low-priority request queued behind it
    threads.append(send("low", priority=0, max_tokens=4))
    engine.wait_for_load("num_waiting_reqs", lambda v: v == 1, timeout=30)

    # when a high-priority request arrives after the low one
    threads.append(send("high", priority=5, max_tokens=4))
    engine.wait_for_load("num_waiting_reqs", lambda v: v == 2, timeout=30)
    for thread in threads:
        thread.join(timeout=120)

    # then the engine served it before the low one, both after the running one
    assert not errors
    assert sorted(finished_at, key=finished_at.__getitem__) == ["long", "high", "low"], finished_at


def test_client_disconnect_aborts_the_request(engine: Engine) -> None:
    # given a long streamed completion that has started
    aborted_before = engine.metric("num_aborted_requests_total", default=0.0)
    body = {
        "model": MODEL,
        "prompt": f"never mind {uuid.uuid4().hex}",
        "max_tokens": 2000,  # ~10 s at full speed on this CPU: far longer than the checks
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{engine.base_url}/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        received = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in received)
        engine.wait_for_load("num_running_reqs", lambda v: v == 1, timeout=60)
        # when the client hangs up long before the 2000th token

    # then the engine stops decoding it (no request running) and serves the next one
    engine.wait_for_load("num_running_reqs", lambda v: v == 0, timeout=60)
    assert engine.metric("num_aborted_requests_total", default=0.0) == aborted_before + 1
    nxt = engine.openai().completions.create(model=MODEL, prompt="next", max_tokens=2)
    assert nxt.usage is not None and nxt.usage.completion_tokens == 2


# -- admin and health endpoints the fleet launcher and router use -----------------------------


@pytest.mark.parametrize("path", ["/health", "/health_generate"])
def test_health_endpoints_answer(engine: Engine, path: str) -> None:
    assert engine.get(path).status_code == 200


def test_model_info_names_the_model(engine: Engine) -> None:
    info = engine.get("/get_model_info").json()

    assert info["model_path"] == str(resolve_paths().model_dir)
    assert info["is_generation"] is True


def test_server_info_reflects_the_launch_flags(engine: Engine) -> None:
    info = engine.get("/get_server_info").json()

    assert info["served_model_name"] == MODEL
    assert info["enable_cache_report"] is True
    assert info["enable_metrics"] is True
    assert info["enable_priority_scheduling"] is True
    assert info["max_running_requests"] == 1
    assert info["device"] == "cpu"


def test_metrics_expose_load_and_token_counters(engine: Engine) -> None:
    text = engine.get("/metrics").text

    for name in ("num_running_reqs", "num_queue_reqs", "prompt_tokens_total", "cached_tokens"):
        assert f"sglang:{name}" in text
