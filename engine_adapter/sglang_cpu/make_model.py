"""Make the tiny random-weight Llama that real SGLang serves on a CPU in tests.

No model weights can be downloaded where the tests run, so the set-up makes one: a seeded
``LlamaForCausalLM`` (hidden 64, 2 layers, 4 heads, 2 KV heads, bf16) with a byte-level BPE
tokenizer trained on a fixed, sorted list of Python standard-library sources, and a chat
template. Its output is gibberish; what matters is that SGLang loads it through the same code
path as a real checkpoint (config, safetensors, tokenizer, chat template).

This script runs inside the SGLang virtualenv (it needs torch, transformers and tokenizers),
so it imports nothing from the platform: ``python make_model.py --out DIR``.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path
from typing import Any

SEED = 20240611
VOCAB_SIZE = 1024
SPECIAL_TOKEN_ROLES = {
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "pad_token": "</s>",
}
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# A small, fixed corpus: the same files on every machine with the same Python.
CORPUS_FILES = [
    "argparse.py",
    "collections/__init__.py",
    "dataclasses.py",
    "email/message.py",
    "functools.py",
    "json/decoder.py",
    "json/encoder.py",
    "pathlib.py",
    "textwrap.py",
    "typing.py",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def train_tokenizer(out: Path) -> Any:
    """Train the byte-level BPE tokenizer and return it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text(encoding="utf-8") for name in CORPUS_FILES]
    tokenizer = Tokenizer(models.BPE(unk_token=SPECIAL_TOKEN_ROLES["unk_token"]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, model_max_length=2048, **SPECIAL_TOKEN_ROLES
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def make_model(out: Path) -> None:
    """Write config, bf16 safetensors weights, tokenizer and chat template to ``out``."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(out)
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    model.save_pretrained(out, safe_serialization=True)
    (out / "tollgate-model.json").write_text(
        json.dumps({"seed": SEED, "vocab_size": len(tokenizer)}, indent=2) + "\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    make_model(parser.parse_args().out)


if __name__ == "__main__":
    main()
