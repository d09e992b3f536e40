"""A small batch through the official openai SDK against REAL SGLang on the CPU (tiny model),
run by a real Celery worker: files.create -> batches.create -> retrieve until completed ->
files.content(output_file_id) parsed, and one usage event per line at tier ``batch``.
"""

from __future__ import annotations

import json

import pytest

from engine_adapter.sglang_cpu import is_ready
from tests.gateway.conftest import stop_gateway
from tests.gateway.test_batch_api import (
    batch_env,
    batch_events,
    results,
    start_stack,
    upload,
    wait_status,
)
from tests.real_sglang import RealEngine, real_sglang

pytestmark = pytest.mark.skipif(
    not is_ready(), reason="the SGLang CPU environment is not set up; run "
                           "`python -m engine_adapter.sglang_cpu setup` first")

MODEL = "small"  # the served name; the weights are the CPU recipe's tiny model


def test_sdk_batch_completes_on_real_sglang(transactional_db, tmp_path, settings,
                                            metering_stream, celery_worker_process):
    stack = None
    with real_sglang(tmp_path / "sglang.log", served_model_name=MODEL,
                     extra_args=("--max-running-requests", "4")) as base_url:
        try:
            stack = start_stack(tmp_path, batch_env(settings, tmp_path, metering_stream,
                                                    TOLLGATE_BATCH_SWEEP_S="5"),
                                [RealEngine(base_url, MODEL)])  # type: ignore[list-item]
            client = stack.client()
            lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": MODEL, "max_tokens": 6, "messages": [
                          {"role": "user", "content": f"Count to {i + 2}."}]}} for i in range(3)]
            lines.append({"custom_id": "c0", "method": "POST", "url": "/v1/chat/completions",
                          "body": {"model": MODEL, "max_tokens": 4, "temperature": 0,
                                   "messages": [{"role": "user", "content": "Hello"}]}})
            file_id = upload(client, lines)
            celery_worker_process(queues="batch", beat=True, env=stack.env)

            batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                          completion_window="24h")
            done = wait_status(client, batch.id, ("completed", "failed"), timeout=240)

            assert done.status == "completed", done
            assert done.request_counts.completed == 4 and done.request_counts.failed == 0
            rows = results(client, done.output_file_id)
            assert sorted(r["custom_id"] for r in rows) == ["c0", "q0", "q1", "q2"]
            for row in rows:
                body = row["response"]["body"]
                assert row["response"]["status_code"] == 200
                assert body["object"] == "chat.completion" and body["model"] == MODEL
                assert 1 <= body["usage"]["completion_tokens"] <= 6
            raw = client.files.content(done.output_file_id).text
            assert all(json.loads(line)["error"] is None for line in raw.splitlines())
            events = batch_events(batch.id, 4)
            assert len(events) == 4 and {e.service_tier for e in events} == {"batch"}
            usage = {r["response"]["request_id"]: r["response"]["body"]["usage"] for r in rows}
            assert all(usage[e.request_id]["prompt_tokens"] == e.prompt_tokens for e in events)
        finally:
            if stack is not None:
                stop_gateway(stack.gateway)
