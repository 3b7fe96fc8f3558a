"""Turning chat messages into one prompt string (and its token ids).

If the tokenizer has a Hugging Face chat template (tokenizer_config.json `chat_template`,
chat_template.jinja, or `--chat-template FILE`), the prompt is exactly the tokenizer's
`apply_chat_template(messages, add_generation_prompt=True)`, and it is tokenized without adding
special tokens again (the template writes BOS etc. itself), as upstream does. Otherwise (the built-in tiny model
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


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None)) and hasattr(tokenizer, "apply_chat_template")


def apply_chat_template(tokenizer, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                        chat_template: str | None = None) -> str:
    """The single entry point for rendering chats. `chat_template` (Jinja text) overrides the
    tokenizer's template for this call."""
    if chat_template is not None or has_chat_template(tokenizer):
        plain = [{"role": m["role"], "content": message_text(m.get("content"), i)}
                 for i, m in enumerate(messages)]
        kwargs = {} if chat_template is None else {"chat_template": chat_template}
        try:
            return tokenizer.apply_chat_template(plain, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as e:  # jinja2 errors (TemplateError, UndefinedError) and raise_exception()
            if isinstance(e, ValueError):
                raise
            raise ValueError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None
    if not add_generation_prompt:
        raise ValueError("add_generation_prompt=False needs a chat template; the built-in role-prefixed "
                         "form always ends with an open assistant turn")
    return render_role_prefixed(messages)


def encode_chat_prompt(tokenizer, prompt_text: str, templated: bool) -> list[int]:
    """Token ids of a rendered chat: a template's output already holds its special tokens."""
    ids = tokenizer.encode(prompt_text, add_special_tokens=False) if templated else tokenizer.encode(prompt_text)
    return list(getattr(ids, "ids", ids))
