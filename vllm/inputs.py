"""Prompt dicts of the Python API (upstream vllm.inputs): TextPrompt and TokensPrompt."""
from __future__ import annotations

from typing import TypedDict, Union

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    prompt: str
    multi_modal_data: NotRequired[object]  # refused: this engine is text-only


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text, when known (returned as RequestOutput.prompt)
    multi_modal_data: NotRequired[object]


PromptType = Union[str, list[int], TextPrompt, TokensPrompt]

_KNOWN_KEYS = {"prompt", "prompt_token_ids", "multi_modal_data"}


def parse_prompt(prompt) -> tuple[str | None, list[int] | None]:
    """-> (text, token_ids); exactly one is needed (token ids win when both are given)."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        unknown = sorted(set(prompt) - _KNOWN_KEYS)
        if unknown:
            raise ValueError(f"prompt dict has unsupported key(s) {unknown}; use TextPrompt "
                             "{'prompt': str} or TokensPrompt {'prompt_token_ids': [int, ...]}")
        if prompt.get("multi_modal_data") is not None:
            raise ValueError("multi_modal_data is not supported: this engine serves text-only "
                             "models; drop the key")
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError(f"prompt_token_ids={ids!r} is invalid: give a list of ints")
            return prompt.get("prompt"), [int(t) for t in ids]
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise ValueError(f"prompt={prompt['prompt']!r} is invalid: it must be a string")
            return prompt["prompt"], None
        raise ValueError("prompt dict has neither 'prompt' nor 'prompt_token_ids'")
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                 for t in prompt):
        return None, [int(t) for t in prompt]
    raise ValueError(f"prompt {prompt!r} is invalid: pass a string, a list of token ids, a "
                     "TextPrompt or a TokensPrompt dict")
