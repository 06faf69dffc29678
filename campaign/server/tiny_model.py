"""Generate a tiny Qwen3 model directory (config + locally trained tokenizer) for `--load-format dummy`.

Run with the server environment's Python, which has `tokenizers` and `transformers`:
    .venv-vllm/bin/python campaign/server/tiny_model.py models/tiny-qwen3
No download: the tokenizer is trained here on text that ships with Python itself. The shape is the one the
CPU notes found to work (head_dim 64; head_dim 16 crashes the CPU attention kernel at the first request).
"""

from __future__ import annotations

import json
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

VOCAB_SIZE = 2048

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


# ChatML, the Qwen family's template (its markers are plain text to this tokenizer: it has no such specials).
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _corpus(limit_files: int = 300) -> Iterator[str]:
    """Deterministic local text: the standard library's own sources, in sorted order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py"))[:limit_files]:
        yield path.read_text(errors="replace")


def generate(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<|pad|>", "<|bos|>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|bos|>", eos_token="<|endoftext|>", pad_token="<|pad|>"
    )
    fast.model_max_length = CONFIG["max_position_embeddings"]
    fast.chat_template = CHAT_TEMPLATE  # the chat endpoint needs one (vLLM refuses chat without)
    fast.save_pretrained(str(out))
    config = dict(CONFIG)
    config["pad_token_id"] = fast.pad_token_id
    config["bos_token_id"] = fast.bos_token_id
    config["eos_token_id"] = fast.eos_token_id
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": fast.bos_token_id, "eos_token_id": fast.eos_token_id}, indent=2) + "\n"
    )


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "models/tiny-qwen3")
    generate(target)
    print(f"tiny model written to {target}")  # noqa: T201
