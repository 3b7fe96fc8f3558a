"""Request and response models of the OpenAI-compatible API (upstream field names).

Requests: only fields we honour are declared with their meaning; fields we cannot honour are
declared too so that `serving.py` can refuse them with HTTP 400 naming the field (instead of
silently dropping them); truly unknown fields are ignored like the OpenAI API does.
Responses are built from the typed models below (`.model_dump()`), never from ad-hoc dicts.
Errors: `APIError` is raised anywhere and rendered in one place (api_server's exception handler)
with the OpenAI shape {"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

import vllm

# Upstream vLLM fills system_fingerprint with None; we name the engine build instead, so clients
# that log it can tell which server answered.
SYSTEM_FINGERPRINT = f"vllm-dspark-{vllm.__version__}"


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str = "text"


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions (upstream names)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # Render logprob tokens as "token_id:{id}" (byte-level tokens often decode to the same "\ufffd").
    return_tokens_as_token_ids: bool | None = None
    # Declared so they can be refused by name (serving.check_supported).
    best_of: int | None = None
    response_format: ResponseFormat | None = None
    use_beam_search: bool | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    structured_outputs: Any = None


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None  # top-k logprobs per token (OpenAI allows up to 5; we allow more)
    prompt_logprobs: int | None = None  # vLLM extension


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


# ---- responses ------------------------------------------------------------------------------------
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: Union[int, str, None] = None
    # vLLM extension (request field prompt_logprobs): one entry per prompt token, first None.
    prompt_logprobs: list[Optional[dict[int, PromptLogprob]]] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    system_fingerprint: str | None = SYSTEM_FINGERPRINT
    usage: UsageInfo | None = None


class CompletionStreamResponse(CompletionResponse):
    pass


class ChatCompletionLogProb(BaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    system_fingerprint: str | None = SYSTEM_FINGERPRINT
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionResponseStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    system_fingerprint: str | None = SYSTEM_FINGERPRINT
    usage: UsageInfo | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "vllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def error_body(message: str, err_type: str = "BadRequestError", code: int = 400,
               param: str | None = None) -> dict[str, Any]:
    """The OpenAI error shape; the openai client surfaces `message` in its exceptions."""
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param,
                                         code=code)).model_dump()


ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
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
