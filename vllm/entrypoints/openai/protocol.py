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
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

import vllm
from vllm.sampling_params import INT32_MAX, INT64_MAX, INT64_MIN, MAX_LIST_LEN, MAX_N

# Upstream vLLM fills system_fingerprint with None; we name the engine build instead, so clients
# that log it can tell which server answered.
SYSTEM_FINGERPRINT = f"vllm-dspark-{vllm.__version__}"


# Bounded field types: the same bounds SamplingParams enforces, checked at the API edge so a bad
# value is an HTTP 400 naming the field before anything is tokenized. Integers that reach int32 /
# int64 buffers must fit them; floats must be finite (JSON's NaN / Infinity / 1e999 are refused
# by allow_inf_nan=False on every request model).
Int32 = Annotated[int, Field(ge=0, le=INT32_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
_REQUEST_CONFIG = ConfigDict(extra="ignore", allow_inf_nan=False)


def check_unicode(value: Any, where: str) -> None:
    """JSON may carry lone surrogates ("\\ud800"): valid JSON, not valid Unicode; tokenizers
    raise on them deep inside. Refuse them here with the field's name (HTTP 400)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            bad = value[error.start:error.end]
            raise ValueError(f"{where} contains the lone surrogate {bad!r} at character "
                             f"{error.start}, which is not valid Unicode; send valid UTF-8 text "
                             "(escape pairs must be complete)") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(key, where)
            check_unicode(item, f"{where}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_unicode(item, f"{where}[{i}]")


class _UnicodeChecked(BaseModel):
    model_config = _REQUEST_CONFIG

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value, info):
        if isinstance(value, BaseModel):
            return value  # nested models check their own fields
        check_unicode(value, info.field_name)
        return value


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str = "text"


class _SamplingFields(_UnicodeChecked):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    stop: Union[str, Annotated[list[str], Field(max_length=MAX_LIST_LEN)], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions (upstream names)
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    min_tokens: Int32 | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_LIST_LEN)] | None = None
    ignore_eos: bool | None = None
    bad_words: Annotated[list[str], Field(max_length=MAX_LIST_LEN)] | None = None
    allowed_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # Render logprob tokens as "token_id:{id}" (byte-level tokens often decode to the same "\ufffd").
    return_tokens_as_token_ids: bool | None = None
    # Declared so they can be refused by name (serving.check_supported).
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    response_format: ResponseFormat | None = None
    use_beam_search: bool | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    structured_outputs: Any = None


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[TokenId], list[list[TokenId]]]
    max_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = 16  # OpenAI's default
    echo: bool = False
    suffix: str | None = None
    # top-k logprobs per token (OpenAI allows up to 5; we allow more); -1 = whole vocabulary.
    logprobs: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    prompt_logprobs: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None  # vLLM extension


class ChatMessage(_UnicodeChecked):
    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(_UnicodeChecked):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_UnicodeChecked):
    model: str | None = None
    tokens: list[TokenId]


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
    405: "MethodNotAllowedError",
    413: "PayloadTooLargeError",
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
