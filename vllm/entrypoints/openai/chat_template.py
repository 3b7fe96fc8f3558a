"""Turning chat messages into one prompt string.

If the tokenizer ships a Hugging Face chat template, it is used. Otherwise (the built-in tiny model
has none) this documented role-prefixed template applies, one line per message and an open
assistant turn at the end:

    System: You are terse.
    User: Hi!
    Assistant: Hello.
    User: What is 2+2?
    Assistant:

Roles are capitalised; message content may be a string or a list of {"type": "text", "text": ...}
parts (other part types are refused: the models served here read text only).
"""
from __future__ import annotations

from typing import Any

ALLOWED_ROLES = ("system", "user", "assistant", "tool", "developer")
GENERATION_PROMPT = "Assistant:"


def message_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"messages[{index}].content has a part of type {kind!r}; "
                             "only text parts ({'type': 'text', 'text': ...}) are supported")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def render_role_prefixed(messages: list[dict[str, Any]]) -> str:
    lines = []
    for index, message in enumerate(messages):
        role = message["role"]
        if role not in ALLOWED_ROLES:
            raise ValueError(f"messages[{index}].role is {role!r}; use one of {', '.join(ALLOWED_ROLES)}")
        lines.append(f"{role.capitalize()}: {message_text(message.get('content'), index)}")
    lines.append(GENERATION_PROMPT)
    return "\n".join(lines)


def apply_chat_template(tokenizer, messages: list[dict[str, Any]]) -> str:
    if getattr(tokenizer, "chat_template", None) and hasattr(tokenizer, "apply_chat_template"):
        plain = [{"role": m["role"], "content": message_text(m.get("content"), i)}
                 for i, m in enumerate(messages)]
        return tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    return render_role_prefixed(messages)
