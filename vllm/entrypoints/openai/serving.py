"""Request handling of /v1/completions and /v1/chat/completions, independent of FastAPI.

Flow of one request: validate what we cannot serve (HTTP 400), tokenize, check the prompt against
max_model_len (HTTP 400 stating both numbers), build SamplingParams (its ValueError becomes HTTP
400), admit every prompt into AsyncLLM *before* answering, so admission errors are real HTTP errors
even for streaming requests; then either collect the final outputs or stream SSE chunks.
The engine emits cumulative text; deltas are cut here.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

from vllm.entrypoints.openai.chat_template import apply_chat_template, encode_chat_prompt, has_chat_template
from vllm.entrypoints.openai.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                              error_body, new_id, now_s, usage)
from vllm.v1.engine.async_llm import AsyncLLM, EngineDeadError

_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_tokens", "seed", "stop", "stop_token_ids",
                    "ignore_eos")


def encode(tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text)
    return list(getattr(ids, "ids", ids))  # tokenizers.Tokenizer returns an Encoding


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


async def merge_streams(streams) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several RequestStreams as (index, output); closing this aborts unfinished ones."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    merged: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index, stream):
        try:
            async for output in stream:
                merged.put_nowait((index, output))
            merged.put_nowait((index, done))
        except Exception as error:  # noqa: BLE001 - forwarded to the consumer
            merged.put_nowait((index, error))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await merged.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


class OpenAIServing:
    def __init__(self, llm: AsyncLLM, tokenizer, model_name: str, max_model_len: int | None):
        self.llm = llm
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len

    # ---- shared validation -------------------------------------------------------------------
    def check_model(self, requested: str | None, aliases: tuple[str, ...] = ()) -> None:
        if requested is not None and requested not in (self.model_name, *aliases):
            raise APIError(f"The model `{requested}` does not exist; this server serves "
                           f"`{self.model_name}` (see /v1/models).", 404, "model")

    @staticmethod
    def check_supported(request) -> None:
        if request.n != 1:
            raise APIError(f"n={request.n} is not supported; this server returns one choice per "
                           "prompt, use n=1", 400, "n")
        if request.logprobs:
            raise APIError("logprobs are not supported by this server; leave `logprobs` unset", 400,
                           "logprobs")
        if getattr(request, "echo", False):
            raise APIError("echo=true is not supported; leave `echo` unset", 400, "echo")
        if getattr(request, "suffix", None):
            raise APIError("suffix is not supported; leave `suffix` unset", 400, "suffix")

    def check_length(self, prompt_ids: list[int], max_tokens: int | None, index: int = 0) -> int:
        """Returns the max_tokens to use; HTTP 400 if the prompt (plus completion) cannot fit."""
        where = f"prompt {index}" if index else "the prompt"
        if not prompt_ids:
            raise APIError(f"{where} is empty; send at least one token", 400, "prompt")
        if self.max_model_len is None:
            return max_tokens
        num = len(prompt_ids)
        if num >= self.max_model_len:
            raise APIError(
                f"{where} has {num} tokens, but this model's maximum context length "
                f"(max_model_len) is {self.max_model_len} tokens and at least one token must be "
                f"generated; shorten the prompt to at most {self.max_model_len - 1} tokens.",
                400, "prompt")
        if max_tokens is None:
            return self.max_model_len - num
        if num + max_tokens > self.max_model_len:
            raise APIError(
                f"This model's maximum context length (max_model_len) is {self.max_model_len} "
                f"tokens, but you requested {num + max_tokens} tokens ({num} in the prompt, "
                f"{max_tokens} in the completion); reduce the prompt or max_tokens.", 400,
                "max_tokens")
        return max_tokens

    def sampling_params(self, request, max_tokens: int | None):
        from vllm.sampling_params import SamplingParams

        kwargs = {name: getattr(request, name) for name in _SAMPLING_FIELDS
                  if getattr(request, name, None) is not None}
        if max_tokens is not None:
            kwargs["max_tokens"] = max_tokens
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as error:
            raise APIError(f"invalid sampling parameters: {error}", 400) from error

    async def admit(self, prompts: list[list[int]], params_list) -> list:
        streams = []
        try:
            for ids, params in zip(prompts, params_list):
                streams.append(await self.llm.add_request(None, ids, params, len(ids)))
        except EngineDeadError as error:
            self._abort(streams)
            raise APIError(f"the engine is not running: {error}", 500) from error
        except ValueError as error:
            self._abort(streams)
            raise APIError(str(error), 400) from error
        return streams

    def _abort(self, streams) -> None:
        for stream in streams:
            self.llm.abort_nowait(stream.request_id)

    def _abort_unfinished(self, streams) -> None:
        self._abort([stream for stream in streams if not stream.finished])

    # ---- /v1/completions ---------------------------------------------------------------------
    def _completion_prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            return [encode(self.tokenizer, prompt)]
        if not prompt:
            raise APIError("prompt is an empty list; send a string or token ids", 400, "prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return [encode(self.tokenizer, p) for p in prompt]
        return [list(p) for p in prompt]

    async def create_completion(self, request: CompletionRequest):
        self.check_model(request.model)
        self.check_supported(request)
        prompts = self._completion_prompts(request.prompt)
        params = [self.sampling_params(request, self.check_length(ids, request.max_tokens, i))
                  for i, ids in enumerate(prompts)]
        streams = await self.admit(prompts, params)
        request_id, created = new_id("cmpl"), now_s()
        if request.stream:
            return self._stream_completion(request, request_id, created, prompts, streams)
        texts, reasons, counts = await self._collect(streams)
        choices = [{"index": i, "text": texts[i], "logprobs": None, "finish_reason": reasons[i],
                    "stop_reason": None} for i in range(len(streams))]
        return {"id": request_id, "object": "text_completion", "created": created,
                "model": self.model_name, "choices": choices,
                "usage": usage(sum(map(len, prompts)), sum(counts))}

    async def _collect(self, streams):
        texts = [""] * len(streams)
        reasons: list[str | None] = [None] * len(streams)
        counts = [0] * len(streams)
        try:
            async for index, output in merge_streams(streams):
                completion = output.outputs[0]
                texts[index], reasons[index] = completion.text, completion.finish_reason
                counts[index] = len(completion.token_ids)
        except EngineDeadError as error:
            raise APIError(f"the engine failed while generating: {error}", 500) from error
        return texts, reasons, counts

    async def _stream_completion(self, request, request_id, created, prompts, streams):
        base = {"id": request_id, "object": "text_completion", "created": created,
                "model": self.model_name}
        sent = [""] * len(streams)
        counts = [0] * len(streams)
        try:
            async for index, output in merge_streams(streams):
                completion = output.outputs[0]
                delta = completion.text[len(sent[index]):]
                sent[index] = completion.text
                counts[index] = len(completion.token_ids)
                reason = completion.finish_reason if output.finished else None
                if delta or reason is not None:
                    yield sse({**base, "choices": [{"index": index, "text": delta, "logprobs": None,
                                                    "finish_reason": reason, "stop_reason": None}]})
            if request.stream_options and request.stream_options.include_usage:
                yield sse({**base, "choices": [], "usage": usage(sum(map(len, prompts)), sum(counts))})
        except EngineDeadError as error:
            yield sse(error_body(f"the engine failed while generating: {error}",
                                 "InternalServerError", 500))
        finally:
            # A client that hangs up closes this generator mid-stream: free its KV blocks now
            # rather than whenever the garbage collector finalises the inner streams.
            self._abort_unfinished(streams)
        yield sse("[DONE]")

    # ---- /v1/chat/completions ----------------------------------------------------------------
    async def create_chat_completion(self, request: ChatCompletionRequest):
        self.check_model(request.model)
        self.check_supported(request)
        messages = [m.model_dump() for m in request.messages]
        try:
            prompt_text = apply_chat_template(self.tokenizer, messages)
        except ValueError as error:
            raise APIError(str(error), 400, "messages") from error
        prompt_ids = encode_chat_prompt(self.tokenizer, prompt_text, has_chat_template(self.tokenizer))
        max_tokens = request.max_completion_tokens or request.max_tokens
        params = self.sampling_params(request, self.check_length(prompt_ids, max_tokens))
        streams = await self.admit([prompt_ids], [params])
        request_id, created = new_id("chatcmpl"), now_s()
        if request.stream:
            return self._stream_chat(request, request_id, created, prompt_ids, streams[0])
        texts, reasons, counts = await self._collect(streams)
        message = {"role": "assistant", "content": texts[0]}
        return {"id": request_id, "object": "chat.completion", "created": created,
                "model": self.model_name,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": reasons[0], "stop_reason": None}],
                "usage": usage(len(prompt_ids), counts[0])}

    async def _stream_chat(self, request, request_id, created, prompt_ids, stream):
        base = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": self.model_name}

        def chunk(delta: dict, reason=None):
            return sse({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                             "finish_reason": reason}]})

        sent, count = "", 0
        try:
            yield chunk({"role": "assistant", "content": ""})
            async for output in stream:
                completion = output.outputs[0]
                delta = completion.text[len(sent):]
                sent, count = completion.text, len(completion.token_ids)
                if delta:
                    yield chunk({"content": delta})
                if output.finished:
                    yield chunk({}, completion.finish_reason)
            if request.stream_options and request.stream_options.include_usage:
                yield sse({**base, "choices": [], "usage": usage(len(prompt_ids), count)})
        except EngineDeadError as error:
            yield sse(error_body(f"the engine failed while generating: {error}",
                                 "InternalServerError", 500))
        finally:
            self._abort_unfinished([stream])
        yield sse("[DONE]")
