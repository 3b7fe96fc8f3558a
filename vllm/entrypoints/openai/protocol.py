"""Request bodies and response builders of the OpenAI-compatible API (the subset we serve).

Only fields we honour are declared; unknown fields are ignored like the OpenAI API does, except
features we cannot serve (n > 1, logprobs, echo, ...), which are refused with HTTP 400 by
`serving.py` rather than silently dropped.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension
    min_tokens: int | None = None  # vLLM extension
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    ignore_eos: bool | None = None  # vLLM extension
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Any = None
    user: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def error_body(message: str, err_type: str = "BadRequestError", code: int = 400,
               param: str | None = None) -> dict[str, Any]:
    """The OpenAI error shape; the openai client surfaces `message` in its exceptions."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """Raised inside handlers; rendered as an OpenAI error response with `status_code`."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, ERROR_TYPES.get(self.status_code, "APIError"),
                          self.status_code, self.param)

