"""HTTP surface of the simulator: SGLang's paths, fields and response shapes.

The adapter, the gateway's streaming relay and the metering of usage are tested against this
server, so it answers exactly where SGLang 0.5 does (``/v1/chat/completions``,
``/v1/completions``, ``/generate``, ``/v1/tokenize``, health, info, cache and abort endpoints,
``/metrics``) with the same JSON and SSE framing, plus two simulator-only endpoints for tests:
``/sim/faults`` (change fault injection at run time) and ``/sim/stats`` (counters).

Known differences from SGLang, on purpose: the cache report is always on (as with
``--enable-cache-report``), batch inputs are refused, fault injection mid-body applies to
``n=1`` answers without logprobs or reasoning only, ``/health`` says only
that the process is up (SGLang's with ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0``; the
generating probe is ``/health_generate``), and constrained output (``response_format``,
forced tool calls: ``sim/structured.py``) is one well-formed answer drawn from the schema,
worded as ``tool_calls`` on the single plain choice only (with ``n`` > 1, logprobs or
reasoning the call's JSON is the content).

Length: one class per SGLang surface would scatter what must be read side by side with
SGLang's own ``http_server.py`` to keep the wire shapes identical; it is a test stand-in, and
the scheduling logic it serves lives in ``engine.py``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import math
import random
import struct
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from engine_adapter.sim.config import Faults, SimConfig
from engine_adapter.sim.engine import Engine, SimRequest
from engine_adapter.sim.metrics import render_metrics
from engine_adapter.sim.structured import ToolCall, constrained, tool_choice_error
from engine_adapter.sim.tokenizer import TemplateError, encode, render_chat, word

SIM_VERSION = "0.5.0-tollgate-sim"
log = logging.getLogger("engine_adapter.sim")
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class ApiError(Exception):
    """An error answered in SGLang's OpenAI error shape."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


class _ConnectionCut(Exception):
    """Raised after the response started so uvicorn drops the connection (fault injection)."""


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """Return SGLang's error JSON (``ErrorResponse``) for a status and message."""
    return {
        "object": "error",
        "message": message,
        "type": _ERROR_TYPES.get(status, "BadRequestError"),
        "param": param,
        "code": status,
    }


def _error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


# --- request parsing --------------------------------------------------------------------------


def _opt_int(body: dict[str, Any], name: str, *, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer", name)
    if minimum is not None and value < minimum:
        raise ApiError(400, f"{name} must be at least {minimum}", name)
    return value


def _opt_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise ApiError(400, f"{name} must be a string", name)
    return value


def _stop_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return [s for s in value if s]
    raise ApiError(400, "stop must be a string or a list of strings", "stop")


def _token_ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise ApiError(400, f"{name} must be a list of non-negative integers", name)
    return list(value)


def _embedding_inputs(value: Any) -> list[list[int]]:
    """Return the token ids of each input of an embeddings body: a string, a list of strings,
    a list of token ids or a list of token-id lists (SGLang's checks and words)."""
    if not value:
        raise ApiError(400, "Input cannot be empty")
    if isinstance(value, str):
        if not value.strip():
            raise ApiError(400, "Input cannot be empty or whitespace only")
        return [encode(value)]
    if not isinstance(value, list):
        raise ApiError(400, "input must be a string or a list", "input")
    first = value[0]
    if isinstance(first, str):
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise ApiError(400, "All items in input list must be strings")
            if not item.strip():
                raise ApiError(400, f"Input at index {i} cannot be empty or whitespace only")
        return [encode(item) for item in value]
    if isinstance(first, int) and not isinstance(first, bool):
        for i, item in enumerate(value):
            if not isinstance(item, int) or isinstance(item, bool):
                raise ApiError(400, "All items in input list must be integers")
            if item < 0:
                raise ApiError(400, f"Token ID at index {i} must be non-negative")
        return [list(value)]
    return [_token_ids(item, "input") for item in value]


def embedding_vector(seed: int, prompt_ids: list[int], dim: int, keep: int | None = None
                     ) -> list[float]:
    """Return the simulated model's embedding of a prompt: a unit vector of ``dim`` entries
    fixed by the server seed and the token ids (the same input always embeds alike); with
    ``keep``, its first ``keep`` entries normalized again, as SGLang's pooler shortens a
    matryoshka model's."""
    digest = hashlib.blake2b(f"{seed}:{prompt_ids}".encode(), digest_size=8).digest()
    rng = random.Random(int.from_bytes(digest, "big"))  # noqa: S311 - a stand-in model, not secrets
    values = [rng.gauss(0.0, 1.0) for _ in range(dim)][:keep]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [v / norm for v in values]


class SimServer:
    """Request handlers bound to one :class:`Engine`."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.engine = Engine(config)

    # --- shared plumbing ----------------------------------------------------------------------

    async def _body(self, request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body() or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"Invalid JSON body: {exc}") from exc
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object")
        return body

    def _check_generation(self) -> None:
        """An embedding engine generates nothing (simulator's words: SGLang's differ)."""
        if self.config.is_embedding:
            raise ApiError(400, "This model is an embedding model (--is-embedding); it "
                           "serves /v1/embeddings and generates nothing.")

    def _check_model(self, body: dict[str, Any]) -> str:
        model = body.get("model")
        if model is None:
            return self.config.served_model_name
        if model not in {self.config.served_model_name, self.config.model_path}:
            raise ApiError(404, f"The model `{model}` does not exist.", "model")
        return self.config.served_model_name

    def _check_n(self, body: dict[str, Any]) -> int:
        return _opt_int(body, "n", minimum=1) or 1

    def _choices(self, body: dict[str, Any], first: SimRequest, n: int, prompt_ids: list[int],
                 **kwargs: Any) -> list[SimRequest]:
        """Return the ``n`` requests of one body: SGLang samples each choice on its own (a
        seeded body gives each choice its own stream, as parallel sampling does)."""
        reqs = [first]
        for i in range(1, n):
            req = self._make_request(body, prompt_ids, **kwargs)
            req.rid = f"{first.rid}-{i}"
            req.request_seed = (first.request_seed or 0) * 1_000_003 + i
            reqs.append(req)
        return reqs

    def _logprobs(self, body: dict[str, Any], *, chat: bool) -> int | None:
        """Return how many top logprobs each token carries, or None when none were asked."""
        if chat:
            if not body.get("logprobs"):
                if body.get("top_logprobs"):
                    raise ApiError(400, "top_logprobs requires logprobs to be true",
                                   "top_logprobs")
                return None
            top = _opt_int(body, "top_logprobs", minimum=0) or 0
            if top > 20:
                raise ApiError(400, "top_logprobs must be between 0 and 20", "top_logprobs")
            return top
        top = _opt_int(body, "logprobs", minimum=0)
        if top is not None and top > 5:
            raise ApiError(400, "logprobs must be between 0 and 5", "logprobs")
        return top

    def _reasoning(self, body: dict[str, Any], *, chat: bool) -> tuple[int, bool]:
        """Return (tokens the model thinks first, whether they are split off as
        ``reasoning_content``), as SGLang's reasoning parser with a Qwen3-style template."""
        kwargs = body.get("chat_template_kwargs") or {}
        if not chat or not self.config.reasoning_tokens or (
                isinstance(kwargs, dict) and kwargs.get("enable_thinking") is False):
            return 0, False
        return self.config.reasoning_tokens, body.get("separate_reasoning", True) is not False

    def _make_request(
        self,
        body: dict[str, Any],
        prompt_ids: list[int],
        *,
        rid_prefix: str,
        max_new_tokens: int | None,
        sampling: dict[str, Any],
    ) -> SimRequest:
        if not prompt_ids:
            raise ApiError(400, "The prompt is empty")
        context = self.config.context_length
        if len(prompt_ids) >= context:
            raise ApiError(
                400,
                f"The input ({len(prompt_ids)} tokens) is longer than the model's context "
                f"length ({context} tokens).",
            )
        if max_new_tokens is not None and len(prompt_ids) + max_new_tokens > context:
            raise ApiError(
                400,
                f"Requested token count exceeds the model's maximum context length of "
                f"{context} tokens. You requested a total of {len(prompt_ids) + max_new_tokens} "
                f"tokens: {len(prompt_ids)} tokens from the input messages and "
                f"{max_new_tokens} tokens for the completion.",
            )
        priority = _opt_int(body, "priority")
        cache_salt = _opt_str(body, "cache_salt")
        extra_key = _opt_str(body, "extra_key")
        rid = _opt_str(body, "rid") or f"{rid_prefix}{uuid.uuid4().hex}"
        stop_ids = sampling.get("stop_token_ids")
        ignore_eos = sampling.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise ApiError(400, "ignore_eos must be a boolean", "ignore_eos")
        return SimRequest(
            rid=rid,
            prompt_ids=prompt_ids,
            max_new_tokens=max_new_tokens,
            stop=_stop_list(sampling.get("stop")),
            stop_token_ids=frozenset(_token_ids(stop_ids, "stop_token_ids") if stop_ids else ()),
            ignore_eos=ignore_eos,
            priority=priority or 0,
            namespace=None if cache_salt is None and extra_key is None else (cache_salt, extra_key),
            request_seed=_opt_int(sampling, "seed"),
        )

    async def _before_output(self) -> Response | None:
        """Apply request-level faults; return the error response to send, if any."""
        if self.engine.count_request():
            return _error_response(500, "Simulated engine fault (error_rate)")
        if self.engine.faults.stall_s > 0:
            await asyncio.sleep(self.engine.faults.stall_s)
        return None

    # --- OpenAI-compatible endpoints ----------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        """POST /v1/chat/completions."""
        body = await self._body(request)
        self._check_generation()
        model = self._check_model(body)
        n = self._check_n(body)
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise ApiError(400, "messages must be a list", "messages")
        try:
            prompt_ids = encode(render_chat(messages))
        except TemplateError as exc:
            raise ApiError(400, str(exc), "messages") from exc
        refused = tool_choice_error(body)
        if refused is not None:
            raise ApiError(400, refused, "tool_choice")
        max_tokens = _opt_int(body, "max_completion_tokens", minimum=0)
        if max_tokens is None:
            max_tokens = _opt_int(body, "max_tokens", minimum=0)
        req = self._make_request(
            body, prompt_ids, rid_prefix="chatcmpl-", max_new_tokens=max_tokens, sampling=body
        )
        reqs = self._choices(body, req, n, prompt_ids, rid_prefix="chatcmpl-",
                             max_new_tokens=max_tokens, sampling=body)
        try:
            grammar = constrained(body, server_seed=self.config.seed,
                                  request_seed=req.request_seed, prompt_ids=prompt_ids)
        except (TypeError, ValueError, AttributeError, KeyError, RecursionError) as exc:
            # what SGLang's grammar backend does with a schema it cannot compile
            raise ApiError(400, f"Failed to build the grammar of the request's JSON schema: "
                           f"{exc}") from exc
        for each in reqs if grammar is not None else ():
            each.fixed_text = grammar.text
        return await self._openai_response(request, body, reqs, model, chat=True,
                                           tool_call=grammar and grammar.tool_call)

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions."""
        body = await self._body(request)
        self._check_generation()
        model = self._check_model(body)
        n = self._check_n(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one is the only batch the simulator takes
        if isinstance(prompt, str):
            prompt_ids = encode(prompt)
        elif isinstance(prompt, list):
            prompt_ids = _token_ids(prompt, "prompt")
        else:
            raise ApiError(400, "prompt must be a string or a list of token ids", "prompt")
        max_tokens = _opt_int(body, "max_tokens", minimum=0)
        if max_tokens is None and "max_tokens" not in body:
            max_tokens = 16  # OpenAI's default for legacy completions
        req = self._make_request(
            body, prompt_ids, rid_prefix="cmpl-", max_new_tokens=max_tokens, sampling=body
        )
        reqs = self._choices(body, req, n, prompt_ids, rid_prefix="cmpl-",
                             max_new_tokens=max_tokens, sampling=body)
        return await self._openai_response(request, body, reqs, model, chat=False)

    async def tokenize(self, request: Request) -> Response:
        """POST /v1/tokenize (and /tokenize), as SGLang's ``serving_tokenize``: chat
        ``messages`` rendered by the chat template (the ids a chat completion would prefill),
        or a ``prompt`` string or list of strings; nothing is queued or run."""
        body = await self._body(request)
        messages, prompt = body.get("messages"), body.get("prompt")
        tokens: list[int] | list[list[int]]
        count: int | list[int]
        try:
            if messages is not None:
                if not isinstance(messages, list):
                    raise ApiError(400, "messages must be a list", "messages")
                tokens = encode(render_chat(messages))
                count = len(tokens)
            elif isinstance(prompt, str):
                tokens = encode(prompt)
                count = len(tokens)
            elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
                tokens = [encode(p) for p in prompt]
                count = [len(ids) for ids in tokens]
            else:
                raise ApiError(400, f"Invalid prompt type: {type(prompt)}. Expected str or "
                               "List[str].")
        except TemplateError as exc:
            raise ApiError(400, str(exc), "messages") from exc
        return JSONResponse({"tokens": tokens, "count": count,
                             "max_model_len": self.config.context_length})

    async def embeddings(self, request: Request) -> Response:
        """POST /v1/embeddings, as SGLang's ``serving_embedding`` with ``--is-embedding``:
        every input is prefilled (queue, running cap and prefill time as a generation's),
        nothing is decoded, and the usage counts the prompts only."""
        body = await self._body(request)
        self._check_model(body)
        encoding = body.get("encoding_format", "float")
        if encoding not in ("float", "base64"):
            raise ApiError(400, "encoding_format must be either 'float' or 'base64', "
                           f"got {encoding!r}")
        inputs = _embedding_inputs(body.get("input"))
        if not self.config.is_embedding:
            raise ApiError(400, "This model does not appear to be an embedding model by "
                           "default. Please add `--is-embedding` when launching the server or "
                           "try another model.")
        dims = _opt_int(body, "dimensions")
        if dims is not None:
            if not self.config.is_matryoshka:
                raise ApiError(400, f"Model '{self.config.model_path}' does not support "
                               "matryoshka representation, changing output dimensions will "
                               "lead to poor results.")
            if dims < 1:
                raise ApiError(400, "Requested dimensions must be greater than 0")
            if dims > self.config.embedding_dim:
                raise ApiError(400, "Provided dimensions are greater than max embedding "
                               f"dimension: {self.config.embedding_dim}")
        rids = body.get("rid")
        batch = isinstance(body["input"], list) and not isinstance(body["input"][0], int)
        if batch and rids is not None and not isinstance(rids, list):
            raise ApiError(500, "Internal server error: The rid should be a list.")
        if isinstance(rids, list) and (len(rids) != len(inputs) or not all(
                isinstance(r, str) for r in rids)):
            raise ApiError(400, "The rid list must hold one string per input", "rid")
        reqs = []
        for i, ids in enumerate(inputs):
            item = {**body, "rid": rids[i] if isinstance(rids, list) else rids}
            req = self._make_request(item, ids, rid_prefix="embd-", max_new_tokens=0,
                                     sampling={})
            req.namespace = ("embedding", req.rid)  # embedding prefills reuse no cache
            reqs.append(req)
        failed = await self._before_output()
        if failed is not None:
            return failed
        # SGLang names the model path (not the served name) in an embedding answer
        return _EmbeddingCall(self.engine, reqs, model=self.config.model_path,
                              seed=self.config.seed, dim=self.config.embedding_dim, keep=dims,
                              base64_out=encoding == "base64")

    async def _openai_response(
        self, request: Request, body: dict[str, Any], reqs: list[SimRequest], model: str, *,
        chat: bool, tool_call: ToolCall | None = None
    ) -> Response:
        stream = bool(body.get("stream", False))
        options = body.get("stream_options") or {}
        include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
        # SGLang's continuous_usage_stats: every chunk carries the usage so far.
        continuous = include_usage and bool(options.get("continuous_usage_stats"))
        logprobs = self._logprobs(body, chat=chat)
        reasoning, separate = self._reasoning(body, chat=chat)
        failed = await self._before_output()
        if failed is not None:
            return failed
        created = int(time.time())
        if len(reqs) > 1 or logprobs is not None or reasoning:
            return _ChoicesCall(self.engine, _ChoicesRenderer(
                reqs, model=model, created=created, chat=chat, logprobs=logprobs,
                reasoning=reasoning, separate_reasoning=separate,
                continuous_usage=continuous), stream=stream, include_usage=include_usage)
        req = reqs[0]
        renderer = _OpenAIRenderer(req, model=model, created=created, chat=chat,
                                   continuous_usage=continuous, tool_call=tool_call)
        return _EngineCall(
            self.engine,
            req,
            full=renderer.full,
            stream_chunks=renderer.chunks if stream else None,
            include_usage=include_usage,
        )

    # --- native endpoint ------------------------------------------------------------------------

    async def generate(self, request: Request) -> Response:
        """POST /generate (SGLang native)."""
        body = await self._body(request)
        self._check_generation()
        text, input_ids = body.get("text"), body.get("input_ids")
        if isinstance(text, list) or (input_ids and isinstance(input_ids[0], list)):
            raise ApiError(400, "Batch requests are not supported by the simulator")
        if isinstance(text, str):
            prompt_ids = encode(text)
        elif input_ids is not None:
            prompt_ids = _token_ids(input_ids, "input_ids")
        else:
            raise ApiError(400, "Either text or input_ids should be provided.")
        sampling = body.get("sampling_params") or {}
        if not isinstance(sampling, dict):
            raise ApiError(400, "sampling_params must be an object", "sampling_params")
        max_new = _opt_int(sampling, "max_new_tokens", minimum=0)
        if max_new is None and "max_new_tokens" not in sampling:
            max_new = 128  # SGLang's default
        req = self._make_request(
            body, prompt_ids, rid_prefix="", max_new_tokens=max_new, sampling=sampling
        )
        failed = await self._before_output()
        if failed is not None:
            return failed
        renderer = _NativeRenderer(req)
        return _EngineCall(
            self.engine,
            req,
            full=renderer.full,
            stream_chunks=renderer.chunks if body.get("stream") else None,
        )

    # --- health, info, control ------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        """GET /health: the process is up."""
        return Response(status_code=200)

    async def health_generate(self, request: Request) -> Response:
        """GET /health_generate: 200 once the scheduler answers, 503 if it does not in time.

        As SGLang's: an idle engine runs a real 1-token generation, a busy one answers from
        the work it is running, and one whose scheduler does not answer within
        ``SGLANG_HEALTH_CHECK_TIMEOUT`` seconds (20) gets a 503 and an error in its log.
        SGLang polls for the answer once a second; the simulator answers as soon as it has it.
        """
        faults = self.engine.faults
        if faults.error_rate and self.engine._fault_rng.random() < faults.error_rate:
            return Response(status_code=503)
        if faults.stall_s > 0:
            await asyncio.sleep(faults.stall_s)
        timeout_s = self.config.health_check_timeout_s
        started = time.strftime("%H:%M:%S")
        if await self.engine.health_check(timeout_s=timeout_s):
            return Response(status_code=200)
        log.error("Health check failed. Server couldn't get a response from detokenizer for "
                  "last %s seconds. tic start time: %s.", timeout_s, started)
        return Response(status_code=503)

    async def models(self, request: Request) -> Response:
        """GET /v1/models."""
        return JSONResponse({
            "object": "list",
            "data": [{
                "id": self.config.served_model_name,
                "object": "model",
                "created": int(self.engine.started_at),
                "owned_by": "sglang",
                "root": self.config.model_path,
                "parent": None,
                "max_model_len": self.config.context_length,
            }],
        })  # fmt: skip

    async def model_info(self, request: Request) -> Response:
        """GET /get_model_info."""
        return JSONResponse({
            "model_path": self.config.model_path,
            "tokenizer_path": self.config.model_path,
            "is_generation": not self.config.is_embedding,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "simulated",
            "architectures": ["SimulatedForCausalLM"],
        })  # fmt: skip

    async def server_info(self, request: Request) -> Response:
        """GET /get_server_info: server args, internal state, and that this is a simulator."""
        c = self.config
        return JSONResponse({
            "simulated": True,
            "version": SIM_VERSION,
            "model_path": c.model_path,
            "served_model_name": c.served_model_name,
            "host": c.host,
            "port": c.port,
            "max_running_requests": c.max_running_requests,
            "max_total_tokens": c.max_total_tokens,
            "context_length": c.context_length,
            "random_seed": c.seed,
            "enable_cache_report": True,
            "enable_metrics": True,
            "enable_priority_scheduling": True,
            "schedule_low_priority_values_first": c.low_priority_values_first,
            "prefill_tokens_per_s": c.prefill_tokens_per_s,
            "decode_tokens_per_s": c.decode_tokens_per_s,
            "internal_states": [{
                "max_total_num_tokens": c.max_total_tokens,
                "max_running_requests": c.max_running_requests,
                "last_gen_throughput": c.decode_tokens_per_s,
            }],
        })  # fmt: skip

    async def flush_cache(self, request: Request) -> Response:
        """POST /flush_cache: drop the prefix cache when idle, as SGLang does."""
        if self.engine.flush_cache():
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse(
            "Cache not flushed: there are running or waiting requests.\n", status_code=400
        )

    async def abort_request(self, request: Request) -> Response:
        """POST /abort_request {"rid": ..., "abort_all": false}."""
        body = await self._body(request)
        self.engine.abort(_opt_str(body, "rid"), abort_all=bool(body.get("abort_all")))
        return Response(status_code=200)

    async def metrics(self, request: Request) -> Response:
        """GET /metrics in Prometheus text format."""
        return PlainTextResponse(
            render_metrics(self.engine), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    async def faults(self, request: Request) -> Response:
        """GET or POST /sim/faults: read or change fault injection."""
        if request.method == "POST":
            body = await self._body(request)
            allowed = set(Faults.__dataclass_fields__)
            unknown = set(body) - allowed
            if unknown:
                raise ApiError(400, f"Unknown fault settings: {sorted(unknown)}")
            for name in ("crash_after", "fail_after_tokens"):
                _opt_int(body, name, minimum=1)
            if not isinstance(body.get("hang", False), bool):
                raise ApiError(400, "hang must be a boolean", "hang")
            for name in ("error_rate", "stall_s"):
                value = body.get(name, 0)
                if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                    raise ApiError(400, f"{name} must be a non-negative number", name)
            self.engine.set_faults(body)
        faults = self.engine.faults
        return JSONResponse({name: getattr(faults, name) for name in Faults.__dataclass_fields__})

    async def stats(self, request: Request) -> Response:
        """GET /sim/stats: counters for tests."""
        engine, stats = self.engine, self.engine.stats
        return JSONResponse({
            "requests": stats.requests,
            "completed": stats.completed,
            "aborted": stats.aborted,
            "errors_injected": stats.errors_injected,
            "cache_hit_requests": stats.cache_hit_requests,
            "cached_tokens": stats.cached_tokens,
            "prompt_tokens": stats.prompt_tokens,
            "generation_tokens": stats.generation_tokens,
            "running": len(engine.running),
            "queued": engine.num_waiting,
            "start_order": stats.start_order,
            "cache": {
                "capacity": engine.config.max_total_tokens,
                "tree_tokens": engine.cache.tree_tokens,
                "evictable_tokens": engine.cache.evictable_tokens,
                "private_tokens": engine.private_tokens,
                "evicted_tokens": engine.cache.evicted_tokens,
                "namespaces": engine.cache.namespaces,
            },
        })  # fmt: skip


# --- response rendering -------------------------------------------------------------------------


def _usage(req: SimRequest) -> dict[str, Any]:
    prompt, completion = len(req.prompt_ids), len(req.output_ids)
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        # SGLang leaves the details out (null) when nothing was cached.
        "prompt_tokens_details": (
            {"cached_tokens": req.cached_tokens} if req.cached_tokens else None
        ),
        "reasoning_tokens": 0,
    }


def _finish(req: SimRequest) -> tuple[str | None, Any]:
    reason = req.finish_reason or {"type": "abort"}
    return reason["type"], reason.get("matched")


class _OpenAIRenderer:
    """Chat and legacy completion bodies and chunks, as SGLang's serving_chat/completions."""

    def __init__(self, req: SimRequest, *, model: str, created: int, chat: bool,
                 continuous_usage: bool = False, tool_call: ToolCall | None = None) -> None:
        self.req = req
        self.continuous_usage = continuous_usage
        # a forced call: its text is worded as OpenAI's tool_calls (SGLang's JSON-array path)
        self.tool_call = tool_call
        self.base = {
            "id": req.rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": model,
        }
        self.chat = chat
        self.sent_role = False
        self._token_frame: list[bytes] | None = None  # a token's frame less text, usage

    def _choice(self, text: str | None, finish: str | None, matched: Any) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            delta: dict[str, Any] = {}
            if not self.sent_role:
                delta["role"] = "assistant"
                self.sent_role = True
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice.update(logprobs=None, finish_reason=finish, matched_stop=matched)
        return choice

    def _finish(self) -> tuple[str | None, Any]:
        finish, matched = _finish(self.req)
        if self.tool_call is not None and finish == "stop":
            return "tool_calls", None  # the call is whole: SGLang says so
        return finish, matched

    def _call_delta(self, call: ToolCall, piece: str) -> dict[str, Any] | None:
        """Return the tool-call delta of a forced call's next piece (None: nothing to say):
        the call's id, type and name first, then its arguments as they are written."""
        end = len(self.req.text)
        start, at = end - len(piece), call.arguments_at
        part = call.arguments[max(0, start - at):max(0, end - at)]
        if not self.sent_role:
            self.sent_role = True
            return {"role": "assistant", "content": None, "tool_calls": [{
                "index": 0, "id": call.call_id, "type": "function",
                "function": {"name": call.name, "arguments": part}}]}
        if not part:
            return None
        return {"tool_calls": [{"index": 0, "function": {"arguments": part}}]}

    def chunks(self, event: str, text: str = "", include_usage: bool = False) -> list[bytes]:
        """Return the SSE frames for a token (``event="token"``) or the end (``"end"``)."""
        usage = _usage(self.req) if self.continuous_usage else None
        if event == "token" and self.tool_call is not None:
            delta = self._call_delta(self.tool_call, text)
            if delta is None:
                return []
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None,
                      "matched_stop": None}
            return [_sse({**self.base, "choices": [choice], "usage": usage})]
        if event == "token" and (self.sent_role or not self.chat):
            # every later token's frame is the same but for its text and usage: render the
            # rest once
            if self._token_frame is None:
                frame = _sse({**self.base, "choices": [self._choice("\0", None, None)],
                              "usage": "\1"})
                head, rest = frame.split(b'"\\u0000"')
                self._token_frame = [head, *rest.split(b'"\\u0001"')]
            head, mid, tail = self._token_frame
            return [b"".join((head, json.dumps(text).encode(), mid,
                              json.dumps(usage, separators=(",", ":")).encode(), tail))]
        if event == "token":
            return [_sse({**self.base, "choices": [self._choice(text, None, None)],
                          "usage": usage})]
        finish, matched = self._finish()
        frames = [
            _sse({**self.base, "choices": [self._choice(None, finish, matched)], "usage": usage})
        ]
        if include_usage:
            frames.append(_sse({**self.base, "choices": [], "usage": _usage(self.req)}))
        frames.append(_sse("[DONE]"))
        return frames

    def full(self) -> dict[str, Any]:
        """Return the non-streaming body."""
        finish, matched = self._finish()
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            call = self.tool_call if finish == "tool_calls" else None
            choice["message"] = {
                "role": "assistant",
                "content": "" if call is not None else self.req.text,
                "reasoning_content": None,
                "tool_calls": None if call is None else [{
                    "id": call.call_id, "index": 0, "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments}}],
            }
        else:
            choice["text"] = self.req.text
        choice.update(logprobs=None, finish_reason=finish, matched_stop=matched)
        obj = "chat.completion" if self.chat else "text_completion"
        return {
            **self.base,
            "object": obj,
            "choices": [choice],
            "usage": _usage(self.req),
            "metadata": {"weight_version": "default"},
        }


def _logprob(token_id: int, rank: int = 0) -> float:
    """A token's simulated log-probability (stable per token id; alternatives rank lower)."""
    return round(-((token_id * 2654435761) % 4096) / 1024 - 0.75 * rank, 6)


async def _watch_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _ChoicesRenderer:
    """Chat and completion answers with ``n`` choices, logprobs or reasoning, as SGLang's
    serving_chat/serving_completions word them; the single plain choice has the faster
    ``_OpenAIRenderer``. Pieces are recorded per choice as the engine yields them."""

    def __init__(self, reqs: list[SimRequest], *, model: str, created: int, chat: bool,
                 logprobs: int | None, reasoning: int, separate_reasoning: bool,
                 continuous_usage: bool) -> None:
        self.reqs = reqs
        self.chat = chat
        self.logprobs = logprobs
        self.reasoning = reasoning
        self.separate = separate_reasoning
        self.continuous_usage = continuous_usage
        self.pieces: list[list[str]] = [[] for _ in reqs]
        self.sent_role = [False] * len(reqs)
        self.base = {"id": reqs[0].rid,
                     "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": created, "model": model}

    def reasoning_count(self, i: int) -> int:
        return min(self.reasoning, len(self.reqs[i].output_ids))

    def usage(self) -> dict[str, Any]:
        """SGLang's UsageProcessor: the prompt (and its cached part) once, completions and
        reasoning tokens summed over the choices."""
        first = self.reqs[0]
        prompt = len(first.prompt_ids)
        completion = sum(len(r.output_ids) for r in self.reqs)
        reasoning = sum(self.reasoning_count(i) for i in range(len(self.reqs)))
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": (
                {"cached_tokens": first.cached_tokens} if first.cached_tokens else None),
            "reasoning_tokens": reasoning,
            "completion_tokens_details": (
                {"reasoning_tokens": reasoning} if reasoning else None),
        }

    def _token_logprobs(self, i: int, start: int, end: int) -> Any:
        if self.logprobs is None:
            return None
        req, pieces = self.reqs[i], self.pieces[i]
        ids, top = req.output_ids[start:end], self.logprobs
        texts = pieces[start:end] + [""] * (len(ids) - len(pieces[start:end]))
        if self.chat:
            def entry(text: str, lp: float) -> dict[str, Any]:
                return {"token": text, "logprob": lp, "bytes": list(text.encode())}

            return {"content": [
                {**entry(text, _logprob(tid)),
                 "top_logprobs": [entry(text if r == 0 else word(tid + r), _logprob(tid, r))
                                  for r in range(top)]}
                for tid, text in zip(ids, texts, strict=True)]}
        offsets, at = [], len("".join(pieces[:start]))
        for text in texts:
            offsets.append(at)
            at += len(text)
        return {"text_offset": offsets, "token_logprobs": [_logprob(t) for t in ids],
                "tokens": texts,
                "top_logprobs": [{(text if r == 0 else word(tid + r)): _logprob(tid, r)
                                  for r in range(top)} or None
                                 for tid, text in zip(ids, texts, strict=True)]}

    def _split(self, i: int) -> tuple[str | None, str]:
        """Return (reasoning_content, content) of choice ``i``'s text so far."""
        text = self.reqs[i].text
        if not self.reasoning:
            return None, text
        thought = "".join(self.pieces[i][:self.reasoning_count(i)])
        if not self.separate:
            return None, text
        return thought, text[len(thought):]

    def token_frame(self, i: int, k: int, piece: str) -> bytes:
        """The frame of choice ``i``'s token ``k`` (already recorded in ``pieces``)."""
        choice: dict[str, Any] = {"index": i}
        if self.chat:
            delta: dict[str, Any] = {}
            if not self.sent_role[i]:
                delta["role"] = "assistant"
                self.sent_role[i] = True
            thinking = self.separate and k < self.reasoning
            delta["reasoning_content" if thinking else "content"] = piece
            choice["delta"] = delta
        else:
            choice["text"] = piece
        choice.update(logprobs=self._token_logprobs(i, k, k + 1), finish_reason=None,
                      matched_stop=None)
        return _sse({**self.base, "choices": [choice],
                     "usage": self.usage() if self.continuous_usage else None})

    def finish_frame(self, i: int) -> bytes:
        finish, matched = _finish(self.reqs[i])
        choice: dict[str, Any] = {"index": i}
        if self.chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        choice.update(logprobs=None, finish_reason=finish, matched_stop=matched)
        return _sse({**self.base, "choices": [choice],
                     "usage": self.usage() if self.continuous_usage else None})

    def end_frames(self, include_usage: bool) -> list[bytes]:
        frames = []
        if include_usage:
            frames.append(_sse({**self.base, "choices": [], "usage": self.usage()}))
        frames.append(_sse("[DONE]"))
        return frames

    def full(self) -> dict[str, Any]:
        """Return the non-streaming body."""
        choices = []
        for i, req in enumerate(self.reqs):
            finish, matched = _finish(req)
            choice: dict[str, Any] = {"index": i}
            if self.chat:
                thought, content = self._split(i)
                choice["message"] = {"role": "assistant", "content": content,
                                     "reasoning_content": thought, "tool_calls": None}
            else:
                choice["text"] = req.text
            choice.update(logprobs=self._token_logprobs(i, 0, len(req.output_ids)),
                          finish_reason=finish, matched_stop=matched)
            choices.append(choice)
        return {**self.base, "object": "chat.completion" if self.chat else "text_completion",
                "choices": choices, "usage": self.usage(),
                "metadata": {"weight_version": "default"}}


class _Watched:
    """An ASGI response whose work (``_run``) is cancelled when the client goes away."""

    async def _run(self, send: Send) -> None:
        raise NotImplementedError

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        work = asyncio.create_task(self._run(send))
        watch = asyncio.create_task(_watch_disconnect(receive))
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            # The client went away: cancelling closes the engine iterator, which frees the slot.
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await work
            return
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
        with contextlib.suppress(OSError):  # the client left while the last bytes went out
            work.result()


class _ChoicesCall(_Watched):
    """ASGI response that runs a body's choices side by side, aborting them all when the
    client goes away; a stream interleaves their tokens as they come, as SGLang's does."""

    def __init__(self, engine: Engine, renderer: _ChoicesRenderer, *, stream: bool,
                 include_usage: bool) -> None:
        self.engine = engine
        self.renderer = renderer
        self.stream = stream
        self.include_usage = include_usage


    async def _run(self, send: Send) -> None:
        renderer = self.renderer
        queue: asyncio.Queue[tuple[int, int, str | None]] = asyncio.Queue()

        async def pump(i: int, req: SimRequest) -> None:
            events = self.engine.generate(req, paced=self.stream)
            try:
                async for piece in events:
                    renderer.pieces[i].append(piece)
                    queue.put_nowait((i, len(renderer.pieces[i]) - 1, piece))
            finally:
                await events.aclose()
                queue.put_nowait((i, -1, None))

        tasks = [asyncio.create_task(pump(i, req)) for i, req in enumerate(renderer.reqs)]
        try:
            if self.stream:
                await send({
                    "type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")],
                })  # fmt: skip
            left = len(tasks)
            while left:
                i, k, piece = await queue.get()
                if not self.stream:
                    left -= piece is None
                    continue
                frame = (renderer.finish_frame(i) if piece is None
                         else renderer.token_frame(i, k, piece))
                left -= piece is None
                await send({"type": "http.response.body", "body": frame, "more_body": True})
            if self.stream:
                await send({"type": "http.response.body",
                            "body": b"".join(renderer.end_frames(self.include_usage))})
                return
            body = json.dumps(renderer.full(), separators=(",", ":")).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


class _NativeRenderer:
    """``/generate`` bodies: cumulative ``text`` plus ``meta_info``, as SGLang streams them."""

    def __init__(self, req: SimRequest) -> None:
        self.req = req

    def _body(self, finished: bool) -> dict[str, Any]:
        req = self.req
        return {
            "text": req.text,
            "output_ids": list(req.output_ids),
            "meta_info": {
                "id": req.rid,
                "finish_reason": (req.finish_reason or {"type": "abort"}) if finished else None,
                "prompt_tokens": len(req.prompt_ids),
                "completion_tokens": len(req.output_ids),
                "cached_tokens": req.cached_tokens,
                "e2e_latency": req.e2e_latency,
                "weight_version": "default",
            },
        }

    def chunks(self, event: str, text: str = "", include_usage: bool = False) -> list[bytes]:
        """Return SSE frames for a token or the end of the stream."""
        if event == "token":
            return [_sse(self._body(False))]
        return [_sse(self._body(True)), _sse("[DONE]")]

    def full(self) -> dict[str, Any]:
        """Return the non-streaming body."""
        return self._body(True)


class _EngineCall(_Watched):
    """ASGI response that runs one request, aborting it when the client goes away."""

    def __init__(
        self,
        engine: Engine,
        req: SimRequest,
        *,
        full: Callable[[], dict[str, Any]],
        stream_chunks: Callable[..., list[bytes]] | None,
        include_usage: bool = False,
    ) -> None:
        self.engine = engine
        self.req = req
        self.full = full
        self.stream_chunks = stream_chunks
        self.include_usage = include_usage


    async def _run(self, send: Send) -> None:
        fail_after = self.engine.faults.fail_after_tokens
        tokens = 0
        events = self.engine.generate(self.req, paced=self.stream_chunks is not None)
        try:
            if self.stream_chunks is None:
                async for _ in events:
                    tokens += 1
                    if fail_after is not None and tokens >= fail_after:
                        break
                body = json.dumps(self.full(), separators=(",", ":")).encode()
                cut = fail_after is not None and tokens >= fail_after
                await send({
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())],
                })  # fmt: skip
                if cut:
                    await send(
                        {
                            "type": "http.response.body",
                            "body": body[: len(body) // 2],
                            "more_body": True,
                        }
                    )
                    raise _ConnectionCut(f"fail_after_tokens={fail_after}")
                await send({"type": "http.response.body", "body": body})
                return
            await send({
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                            (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")],
            })  # fmt: skip
            async for piece in events:
                for frame in self.stream_chunks("token", piece):
                    await send({"type": "http.response.body", "body": frame, "more_body": True})
                tokens += 1
                if fail_after is not None and tokens >= fail_after:
                    raise _ConnectionCut(f"fail_after_tokens={fail_after}")
            frames = self.stream_chunks("end", include_usage=self.include_usage)
            await send({"type": "http.response.body", "body": b"".join(frames)})
        finally:
            await events.aclose()


@dataclass(eq=False)
class _EmbeddingCall(_Watched):
    """ASGI response that prefills an embeddings body's inputs side by side (aborted when the
    client goes away) and answers SGLang's ``EmbeddingResponse``: ``dim`` floats each, the
    first ``keep`` when shortened."""

    engine: Engine
    reqs: list[SimRequest]
    model: str
    seed: int
    dim: int
    keep: int | None
    base64_out: bool

    async def _one(self, req: SimRequest) -> None:
        events = self.engine.generate(req, paced=False)
        try:
            async for _ in events:
                pass
        finally:
            await events.aclose()

    def _encoded(self, vector: list[float]) -> list[float] | str:
        if not self.base64_out:
            return vector
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")

    async def _run(self, send: Send) -> None:
        await asyncio.gather(*(self._one(req) for req in self.reqs))
        prompt = sum(len(req.prompt_ids) for req in self.reqs)
        data = [{"embedding": self._encoded(embedding_vector(self.seed, req.prompt_ids,
                                                             self.dim, self.keep)),
                 "index": i, "object": "embedding"} for i, req in enumerate(self.reqs)]
        body = json.dumps({"data": data, "model": self.model, "object": "list",
                           "usage": {"prompt_tokens": prompt, "total_tokens": prompt,
                                     "completion_tokens": 0, "prompt_tokens_details": None,
                                     "reasoning_tokens": 0,
                                     "completion_tokens_details": None}},
                          separators=(",", ":")).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _route_errors(handler: Callable[[Request], Awaitable[Response]]) -> Callable[..., Any]:
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as exc:
            return _error_response(exc.status, exc.message, exc.param)

    return wrapped


class _SimApp(Starlette):
    """Starlette, with the generation routes called directly.

    Starlette's router and its two middlewares wrap every ``send``, and a streamed token is
    one ``send``: that was most of what a token cost the simulator's event loop, which
    benchmarks share with the gateway they measure. The other routes go through Starlette.
    """

    def __init__(self, routes: list[Route], generation: dict[str, Callable[..., Any]]) -> None:
        super().__init__(routes=routes)
        self.generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = (self.generation.get(scope["path"])
                   if scope["type"] == "http" and scope["method"] == "POST" else None)
        if handler is None:
            await super().__call__(scope, receive, send)
            return
        response = await handler(Request(scope, receive))
        await response(scope, receive, send)


def create_app(config: SimConfig) -> Starlette:
    """Build the simulator's ASGI application."""
    server = SimServer(config)
    generation = {"/v1/chat/completions": _route_errors(server.chat_completions),
                  "/v1/completions": _route_errors(server.completions),
                  "/v1/embeddings": _route_errors(server.embeddings),
                  "/generate": _route_errors(server.generate)}
    routes = [
        *(Route(path, handler, methods=["POST"]) for path, handler in generation.items()),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/health_generate", server.health_generate, methods=["GET"]),
        Route("/get_model_info", server.model_info, methods=["GET"]),
        Route("/get_server_info", server.server_info, methods=["GET"]),
        Route("/server_info", server.server_info, methods=["GET"]),
        Route("/flush_cache", server.flush_cache, methods=["GET", "POST"]),
        Route("/abort_request", _route_errors(server.abort_request), methods=["POST"]),
        *(Route(path, _route_errors(server.tokenize), methods=["POST"])
          for path in ("/v1/tokenize", "/tokenize")),
        Route("/metrics", server.metrics, methods=["GET"]),
        Route("/sim/faults", _route_errors(server.faults), methods=["GET", "POST"]),
        Route("/sim/stats", server.stats, methods=["GET"]),
    ]
    app = _SimApp(routes, generation)
    app.state.sim = server
    return app
