"""A chat-templated copy of the tiny target (template in tokenizer_config.json, BOS written by the
template itself), for the chat rendering tests of LLM.chat and the server."""
from __future__ import annotations

import json
import os
import shutil

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eos|>"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a colour."}]


def write_chat_checkpoint(tiny_target: str, dst: str, template: str = CHAT_TEMPLATE) -> str:
    shutil.copytree(tiny_target, dst, dirs_exist_ok=True)
    path = os.path.join(dst, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["chat_template"] = template
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    return dst


def expected_prompt_ids(model_dir: str, messages=MESSAGES) -> tuple[str, list[int]]:
    """The oracle: Hugging Face's own rendering and tokenization of the conversation."""
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text, list(hf.encode(text, add_special_tokens=False))
