"""Simulated SGLang engine: NOT a product engine.

It speaks SGLang 0.5's HTTP API (OpenAI-compatible chat and completions with streaming and
usage, native ``/generate``, health, info, cache, abort and ``/metrics``) so the platform can be
tested fast, with injected faults, and at fleet sizes no laptop can hold. Behind the API sit a
deterministic tokenizer and "model" (``tokenizer``), a real radix prefix cache (``radix``) and a
queue/prefill/decode time model (``engine``). Nothing here imports Django or the platform.

Start one with ``python -m engine_adapter.sim --port 30001 --served-model-name m`` or, in tests,
with :func:`engine_adapter.sim.testing.start_sim`.
"""
