"""Deterministic stand-in tokenizer, chat template and "model" for the engine simulator.

The simulator needs token counts that are stable across processes and runs (billing tests
compare them), prefix-friendly token ids (so the radix cache behaves like SGLang's), and
completions that repeat exactly for the same prompt. No real tokenizer gives all that without
downloading a model, so the scheme is deliberately simple and documented here:

* Text is split by ``TOKEN_PATTERN``: a special marker like ``<|im_start|>``, a run of word
  characters, one punctuation character, or a run of whitespace. Each piece is one token.
* A piece's id is ``FIRST_PIECE_ID + blake2b(piece) mod (2**31 - FIRST_PIECE_ID)``; ids below
  ``FIRST_PIECE_ID`` are reserved (``EOS_TOKEN_ID`` is 2). Python's ``hash`` is salted per
  process, so it is not used.
* Chat messages are rendered with a ChatML template (the one Qwen models use with SGLang):
  ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, then ``<|im_start|>assistant\\n``.
* The completion is a pseudo-random word sequence seeded by (server seed, request seed,
  prompt token ids): the same prompt always gives the same text and the same token ids.
"""

from __future__ import annotations

import functools
import hashlib
import random
import re
from collections.abc import Iterator, Sequence
from typing import Any

TOKEN_PATTERN = re.compile(r"<\|[A-Za-z0-9_]+\|>|\w+|[^\w\s]|\s+")
FIRST_PIECE_ID = 1000
EOS_TOKEN_ID = 2
VOCAB_SIZE = 2**31

_WORD_TEXT = (
    "the engine meters every token and the ledger keeps each count exact while requests "
    "arrive from many tenants across regions so the cache warms quickly and prefill grows "
    "cheaper over time because shared prefixes stay resident until pressure evicts them "
    "from memory in least recently used order which keeps latency low for busy users"
)
_WORDS = tuple(_WORD_TEXT.split())


def word(i: int) -> str:
    """Return one of the simulated model's words (stand-ins for a logprob's alternatives)."""
    return _WORDS[i % len(_WORDS)]


class TemplateError(ValueError):
    """A chat message the simulator cannot render (bad role, non-text content)."""


@functools.lru_cache(maxsize=8192)  # completions draw from a few dozen words: hashed once
def piece_id(piece: str) -> int:
    """Return the stable token id of one text piece."""
    digest = hashlib.blake2b(piece.encode("utf-8"), digest_size=8).digest()
    return FIRST_PIECE_ID + int.from_bytes(digest, "big") % (VOCAB_SIZE - FIRST_PIECE_ID)


def split_pieces(text: str) -> list[str]:
    """Split text into token pieces; joining them gives the text back."""
    return TOKEN_PATTERN.findall(text)


def encode(text: str) -> list[int]:
    """Return the token ids of a text."""
    return [piece_id(piece) for piece in split_pieces(text)]


def _message_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise TemplateError("only text content parts are supported by this model")
            text = part.get("text")
            if not isinstance(text, str):
                raise TemplateError("a text content part needs a string 'text'")
            parts.append(text)
        return "".join(parts)
    raise TemplateError("message content must be a string or a list of text parts")


def render_chat(messages: Sequence[Any]) -> str:
    """Render chat messages to prompt text with the ChatML template."""
    if not messages:
        raise TemplateError("messages must be a non-empty list")
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise TemplateError("each message must be an object")
        role = message.get("role")
        if role not in {"system", "developer", "user", "assistant", "tool"}:
            raise TemplateError(f"unsupported message role: {role!r}")
        out.append(f"<|im_start|>{role}\n{_message_text(message.get('content'))}<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    return "".join(out)


def completion_stream(
    *, server_seed: int, request_seed: int | None, prompt_ids: Sequence[int], ignore_eos: bool
) -> Iterator[tuple[int, str]]:
    """Yield (token id, text piece) of the deterministic completion; EOS is (EOS_TOKEN_ID, "")."""
    material = f"{server_seed}:{request_seed}:" + ",".join(map(str, prompt_ids))
    rng = random.Random(hashlib.sha256(material.encode()).digest())  # noqa: S311 - not crypto
    natural_length = rng.randint(24, 96)
    emitted = 0
    sentence_start = True
    while True:
        word = rng.choice(_WORDS)
        if sentence_start:
            word = word.capitalize()
        sentence_start = rng.random() < 0.12
        for piece in (word, ".", " ") if sentence_start else (word, " "):
            if emitted >= natural_length and not ignore_eos:
                yield EOS_TOKEN_ID, ""
                return
            yield piece_id(piece), piece
            emitted += 1
