"""Request handling of /v1/completions, /v1/chat/completions, /tokenize and /detokenize,
independent of FastAPI.

Flow of one request: refuse what we cannot serve (HTTP 400 naming the field), tokenize, check the
prompt against max_model_len (HTTP 400 stating both numbers), build SamplingParams (its ValueError
becomes HTTP 400), admit every prompt into AsyncLLM *before* answering, so admission errors are
real HTTP errors even for streaming requests; then either collect the final outputs or stream SSE
chunks. Tokenization (and chat templating) runs on a one-thread pool, never on the event loop,
after a character-count bound has refused prompts that cannot possibly fit (a 16 MB prompt is
refused without being tokenized, and /health stays responsive meanwhile). The engine emits cumulative text / tokens / logprobs per sample (n > 1 lives in the
engine: one RequestOutput carries all n samples); deltas are cut here. Choice index of sample j
of prompt i is i * n + j (upstream).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
from typing import Any, AsyncIterator

from vllm.entrypoints.openai.chat_template import (apply_chat_template, encode_chat_prompt,
                                                   has_chat_template)
from vllm.entrypoints.openai.protocol import (
    APIError, ChatCompletionLogProb, ChatCompletionLogProbs, ChatCompletionLogProbsContent,
    ChatCompletionRequest, ChatCompletionResponse, ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice, ChatCompletionStreamResponse, ChatResponseMessage,
    CompletionLogProbs, CompletionRequest, CompletionResponse, CompletionResponseChoice,
    CompletionStreamResponse, DeltaMessage, DetokenizeRequest, DetokenizeResponse, PromptLogprob,
    TokenizeRequest, TokenizeResponse, error_body, new_id, now_s, usage)
from vllm.v1.engine.async_llm import AsyncLLM, EngineDeadError, RequestFailedError

# Request fields copied into SamplingParams as they are (upstream names on both sides).
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "min_tokens", "seed", "stop",
                    "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "logit_bias", "bad_words", "allowed_token_ids",
                    "skip_special_tokens", "include_stop_str_in_output")


def encode(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    try:
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except TypeError:  # tokenizers without the keyword
        ids = tokenizer.encode(text)
    return list(getattr(ids, "ids", ids))  # tokenizers.Tokenizer returns an Encoding


def sse(payload) -> str:
    if hasattr(payload, "model_dump"):
        payload = payload.model_dump()
        for choice in payload.get("choices", ()):
            if isinstance(choice.get("delta"), dict):
                # Upstream sends only the delta fields that are set ({} on the final chunk).
                choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
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


def longest_token_chars(tokenizer) -> int | None:
    """Characters in the longest vocabulary entry: a text of C characters has at least
    C / this many tokens (byte-level BPE and SentencePiece store one character per byte or
    piece; special tokens only add to the count). None if the vocabulary cannot be read."""
    try:
        for holder in (tokenizer, getattr(tokenizer, "backend", None)):
            get_vocab = getattr(holder, "get_vocab", None)
            if get_vocab is not None:
                vocab = list(get_vocab())
                break
        else:
            size = getattr(tokenizer, "vocab_size", None)
            if not isinstance(size, int):
                return None
            vocab = [t for t in tokenizer.convert_ids_to_tokens(range(size)) if t is not None]
    except Exception:  # noqa: BLE001 - no bound is better than a wrong one
        return None
    return max((len(token) for token in vocab), default=None) or None


class OpenAIServing:
    def __init__(self, llm: AsyncLLM, tokenizer, model_name: str, max_model_len: int | None):
        self.llm = llm
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        # One thread: the tokenizer instance is only ever used from it (not thread-safe), and the
        # event loop stays free to answer /health and other clients while it works.
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="vllm-tokenizer")
        longest = longest_token_chars(tokenizer) if max_model_len else None
        # x2 margin: a normalizer may merge characters (NFC composes "e" + U+0301 into one).
        self.max_prompt_chars = 2 * max_model_len * longest if longest else None

    async def run_tokenizer(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenizer_pool, functools.partial(fn, *args))

    def check_text_length(self, text: str | int, index: int = 0, field: str = "prompt") -> None:
        """Refuse a text (or a total character count) that cannot fit before tokenizing it."""
        num_chars = text if isinstance(text, int) else len(text)
        if self.max_prompt_chars is not None and num_chars > self.max_prompt_chars:
            where = f"{field} {index}" if index else f"the {field}"
            raise APIError(
                f"{where} has {num_chars} characters, so more tokens than this model's maximum "
                f"context length (max_model_len) of {self.max_model_len} tokens; shorten it "
                f"(at most {self.max_prompt_chars} characters can ever fit).", 400, field)

    # ---- shared validation -------------------------------------------------------------------
    def check_model(self, requested: str | None, aliases: tuple[str, ...] = ()) -> None:
        if requested is not None and requested not in (self.model_name, *aliases):
            raise APIError(f"The model `{requested}` does not exist; this server serves "
                           f"`{self.model_name}` (see /v1/models).", 404, "model")

    @staticmethod
    def check_supported(request) -> None:
        """HTTP 400 naming each field we would otherwise have to drop silently."""
        if request.n < 1:
            raise APIError(f"n={request.n} is invalid: it must be >= 1", 400, "n")
        if request.best_of is not None and request.best_of != request.n:
            raise APIError(f"best_of={request.best_of} is not supported (beam-free best-of-n "
                           "ranking is not implemented); leave it unset or equal to n", 400,
                           "best_of")
        if request.use_beam_search:
            raise APIError("use_beam_search is not supported; leave it unset", 400,
                           "use_beam_search")
        if request.response_format is not None and request.response_format.type != "text":
            raise APIError(f"response_format type {request.response_format.type!r} is not "
                           "supported (no structured output); use {'type': 'text'} or leave it "
                           "unset", 400, "response_format")
        for name in ("guided_json", "guided_regex", "guided_choice", "structured_outputs"):
            if getattr(request, name, None) is not None:
                raise APIError(f"{name} is not supported (no structured output); leave it unset",
                               400, name)
        if getattr(request, "suffix", None):
            raise APIError("suffix is not supported; leave `suffix` unset", 400, "suffix")
        tools = getattr(request, "tools", None)
        if tools and getattr(request, "tool_choice", None) != "none":
            raise APIError("tools are not supported (no tool-call parser); leave `tools` unset or "
                           "pass tool_choice='none'", 400, "tools")
        if getattr(request, "prompt_logprobs", None) is not None and request.stream:
            raise APIError("prompt_logprobs is only supported without streaming; drop one of "
                           "prompt_logprobs or stream", 400, "prompt_logprobs")
        if getattr(request, "echo", False) and request.stream and request.logprobs is not None:
            raise APIError("echo with logprobs is only supported without streaming; drop one of "
                           "echo, logprobs or stream", 400, "echo")

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

    def sampling_params(self, request, max_tokens: int | None, logprobs: int | None = None,
                        prompt_logprobs: int | None = None):
        from vllm.sampling_params import SamplingParams

        kwargs = {name: getattr(request, name) for name in _SAMPLING_FIELDS
                  if getattr(request, name, None) is not None}
        kwargs["n"] = request.n
        if max_tokens is not None:
            kwargs["max_tokens"] = max_tokens
        if logprobs is not None:
            kwargs["logprobs"] = logprobs
        if prompt_logprobs is not None:
            kwargs["prompt_logprobs"] = prompt_logprobs
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

    def _token_str(self, as_ids: bool, token_id: int, entry=None) -> str:
        if as_ids:
            return f"token_id:{token_id}"
        decoded = getattr(entry, "decoded_token", None) if entry is not None else None
        if decoded is not None:
            return decoded
        return self.tokenizer.decode([token_id])

    # ---- /v1/completions ---------------------------------------------------------------------
    async def _completion_prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            self.check_text_length(prompt)
            return [await self.run_tokenizer(encode, self.tokenizer, prompt)]
        if not prompt:
            raise APIError("prompt is an empty list; send a string or token ids", 400, "prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            for i, p in enumerate(prompt):
                self.check_text_length(p, i)
            return await self.run_tokenizer(
                lambda texts: [encode(self.tokenizer, t) for t in texts], prompt)
        return [list(p) for p in prompt]

    async def create_completion(self, request: CompletionRequest):
        self.check_model(request.model)
        self.check_supported(request)
        prompts = await self._completion_prompts(request.prompt)
        # echo + logprobs also scores the prompt (upstream: prompt_logprobs = logprobs).
        prompt_lps = request.prompt_logprobs
        if request.echo and request.logprobs is not None:
            prompt_lps = request.logprobs
        params = [self.sampling_params(request, self.check_length(ids, request.max_tokens, i),
                                       request.logprobs, prompt_lps)
                  for i, ids in enumerate(prompts)]
        streams = await self.admit(prompts, params)
        request_id, created = new_id("cmpl"), now_s()
        if request.stream:
            return self._stream_completion(request, request_id, created, prompts, streams)
        finals = await self._collect(streams)
        as_ids = bool(request.return_tokens_as_token_ids)
        choices = []
        num_generated = 0
        for i, output in enumerate(finals):
            prompt_text = self.tokenizer.decode(prompts[i]) if request.echo else ""
            for completion in output.outputs:
                num_generated += len(completion.token_ids)
                logprobs = None
                if request.logprobs is not None:
                    logprobs = CompletionLogProbs()
                    offset = 0
                    if request.echo:
                        offset = self._add_prompt_logprobs(logprobs, prompts[i],
                                                           getattr(output, "prompt_logprobs", None),
                                                           as_ids)
                    self._add_completion_logprobs(logprobs, completion.token_ids,
                                                  completion.logprobs, offset, as_ids)
                prompt_lp = None
                if request.prompt_logprobs is not None:
                    prompt_lp = [None if entry is None else
                                 {t: PromptLogprob(logprob=lp.logprob, rank=lp.rank,
                                                   decoded_token=self._token_str(as_ids, t, lp))
                                  for t, lp in entry.items()}
                                 for entry in (getattr(output, "prompt_logprobs", None) or [])]
                choices.append(CompletionResponseChoice(
                    index=i * request.n + completion.index, text=prompt_text + completion.text,
                    logprobs=logprobs, finish_reason=completion.finish_reason,
                    stop_reason=getattr(completion, "stop_reason", None),
                    prompt_logprobs=prompt_lp))
        return CompletionResponse(id=request_id, created=created, model=self.model_name,
                                  choices=choices,
                                  usage=usage(sum(map(len, prompts)), num_generated)).model_dump()

    def _add_prompt_logprobs(self, out: CompletionLogProbs, prompt_ids, prompt_logprobs,
                             as_ids: bool = False) -> int:
        offset = 0
        for j, token in enumerate(prompt_ids):
            entry = prompt_logprobs[j] if prompt_logprobs is not None and j < len(
                prompt_logprobs) else None
            text = self._token_str(as_ids, token, entry.get(token) if entry else None)
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(text)
            if entry is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                out.token_logprobs.append(max(entry[token].logprob, -9999.0))
                out.top_logprobs.append({self._token_str(as_ids, t, lp): max(lp.logprob, -9999.0)
                                         for t, lp in entry.items()})
        return offset

    def _add_completion_logprobs(self, out: CompletionLogProbs, token_ids, logprobs,
                                 offset: int, as_ids: bool = False) -> int:
        for token, entry in zip(token_ids, logprobs or ()):
            text = self._token_str(as_ids, token, entry.get(token))
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(text)
            out.token_logprobs.append(max(entry[token].logprob, -9999.0))
            out.top_logprobs.append({self._token_str(as_ids, t, lp): max(lp.logprob, -9999.0)
                                     for t, lp in entry.items()})
        return offset

    async def _collect(self, streams) -> list:
        finals: list = [None] * len(streams)
        try:
            async for index, output in merge_streams(streams):
                finals[index] = output
        except EngineDeadError as error:
            raise APIError(f"the engine failed while generating: {error}", 500) from error
        except RequestFailedError as error:
            raise APIError(str(error), 500) from error
        return finals

    async def _stream_completion(self, request, request_id, created, prompts, streams):
        n = request.n
        sent_text: dict[int, str] = {}
        sent_tokens: dict[int, int] = {}
        counts: dict[int, int] = {}
        finished: set[int] = set()
        try:
            async for i, output in merge_streams(streams):
                for completion in output.outputs:
                    index = i * n + completion.index
                    if index in finished:
                        continue
                    first = index not in sent_text
                    prev = sent_text.get(index, "")
                    delta = completion.text[len(prev):]
                    sent_text[index] = completion.text
                    counts[index] = len(completion.token_ids)
                    if first and request.echo:
                        delta = self.tokenizer.decode(prompts[i]) + delta
                    logprobs = None
                    start = sent_tokens.get(index, 0)
                    if request.logprobs is not None and completion.logprobs is not None:
                        logprobs = CompletionLogProbs()
                        self._add_completion_logprobs(logprobs, completion.token_ids[start:],
                                                      completion.logprobs[start:], len(prev),
                                                      bool(request.return_tokens_as_token_ids))
                    sent_tokens[index] = len(completion.token_ids)
                    reason = completion.finish_reason
                    if reason is not None:
                        finished.add(index)
                    if delta or reason is not None or (logprobs and logprobs.tokens):
                        choice = CompletionResponseChoice(
                            index=index, text=delta, logprobs=logprobs, finish_reason=reason,
                            stop_reason=getattr(completion, "stop_reason", None)
                            if reason else None)
                        yield sse(CompletionStreamResponse(id=request_id, created=created,
                                                           model=self.model_name,
                                                           choices=[choice]))
            if request.stream_options and request.stream_options.include_usage:
                yield sse(CompletionStreamResponse(
                    id=request_id, created=created, model=self.model_name, choices=[],
                    usage=usage(sum(map(len, prompts)), sum(counts.values()))))
        except EngineDeadError as error:
            yield sse(error_body(f"the engine failed while generating: {error}",
                                 "InternalServerError", 500))
        except RequestFailedError as error:
            yield sse(error_body(str(error), "InternalServerError", 500))
        finally:
            # A client that hangs up closes this generator mid-stream: free its KV blocks now
            # rather than whenever the garbage collector finalises the inner streams.
            self._abort_unfinished(streams)
        yield sse("[DONE]")

    # ---- /v1/chat/completions ----------------------------------------------------------------
    def _check_messages_length(self, messages) -> None:
        # Only the text parts count: the template adds characters, it never removes any.
        total = 0
        for m in messages:
            if isinstance(m.content, str):
                total += len(m.content)
            elif isinstance(m.content, list):
                total += sum(len(part.get("text") or "") for part in m.content
                             if isinstance(part, dict) and isinstance(part.get("text"), str))
        self.check_text_length(total, field="messages")

    async def _chat_prompt(self, request: ChatCompletionRequest) -> list[int]:
        self._check_messages_length(request.messages)
        messages = [m.model_dump() for m in request.messages]
        return await self.run_tokenizer(self._render_and_encode, messages)

    def _render_and_encode(self, messages) -> list[int]:
        try:
            prompt_text = apply_chat_template(self.tokenizer, messages)
        except ValueError as error:
            raise APIError(str(error), 400, "messages") from error
        return encode_chat_prompt(self.tokenizer, prompt_text, has_chat_template(self.tokenizer))

    def _chat_logprobs(self, token_ids, logprobs, top_k: int,
                       as_ids: bool = False) -> ChatCompletionLogProbs:
        content = []
        for token, entry in zip(token_ids, logprobs or ()):
            text = self._token_str(as_ids, token, entry.get(token))
            top = [ChatCompletionLogProb(token=self._token_str(as_ids, t, lp),
                                         logprob=max(lp.logprob, -9999.0),
                                         bytes=list(self._token_str(as_ids, t, lp).encode()))
                   for t, lp in entry.items() if lp.rank is not None and lp.rank <= top_k][:top_k]
            content.append(ChatCompletionLogProbsContent(
                token=text, logprob=max(entry[token].logprob, -9999.0),
                bytes=list(text.encode()), top_logprobs=top))
        return ChatCompletionLogProbs(content=content)

    async def create_chat_completion(self, request: ChatCompletionRequest):
        self.check_model(request.model)
        self.check_supported(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError("top_logprobs needs logprobs=true", 400, "top_logprobs")
        prompt_ids = await self._chat_prompt(request)
        # `is not None`: an explicit max_completion_tokens of 0 must not fall back to max_tokens.
        max_tokens = (request.max_completion_tokens if request.max_completion_tokens is not None
                      else request.max_tokens)
        top_k = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(request, self.check_length(prompt_ids, max_tokens), top_k)
        streams = await self.admit([prompt_ids], [params])
        request_id, created = new_id("chatcmpl"), now_s()
        if request.stream:
            return self._stream_chat(request, request_id, created, prompt_ids, streams[0], top_k)
        output = (await self._collect(streams))[0]
        choices = [ChatCompletionResponseChoice(
            index=c.index, message=ChatResponseMessage(content=c.text),
            logprobs=(self._chat_logprobs(c.token_ids, c.logprobs, top_k,
                                          bool(request.return_tokens_as_token_ids))
                      if top_k is not None else None),
            finish_reason=c.finish_reason, stop_reason=getattr(c, "stop_reason", None))
            for c in output.outputs]
        return ChatCompletionResponse(
            id=request_id, created=created, model=self.model_name, choices=choices,
            usage=usage(len(prompt_ids), sum(len(c.token_ids) for c in output.outputs))
        ).model_dump()

    async def _stream_chat(self, request, request_id, created, prompt_ids, stream, top_k):
        def chunk(index: int, delta: DeltaMessage, reason=None, logprobs=None, stop_reason=None):
            choice = ChatCompletionResponseStreamChoice(index=index, delta=delta,
                                                        logprobs=logprobs, finish_reason=reason,
                                                        stop_reason=stop_reason)
            return sse(ChatCompletionStreamResponse(id=request_id, created=created,
                                                    model=self.model_name, choices=[choice]))

        sent_text: dict[int, str] = {}
        sent_tokens: dict[int, int] = {}
        counts: dict[int, int] = {}
        finished: set[int] = set()
        try:
            for index in range(request.n):
                yield chunk(index, DeltaMessage(role="assistant", content=""))
            async for output in stream:
                for c in output.outputs:
                    if c.index in finished:
                        continue
                    delta = c.text[len(sent_text.get(c.index, "")):]
                    sent_text[c.index] = c.text
                    counts[c.index] = len(c.token_ids)
                    start = sent_tokens.get(c.index, 0)
                    sent_tokens[c.index] = len(c.token_ids)
                    logprobs = None
                    if top_k is not None and c.logprobs is not None and len(c.token_ids) > start:
                        logprobs = self._chat_logprobs(c.token_ids[start:], c.logprobs[start:],
                                                       top_k,
                                                       bool(request.return_tokens_as_token_ids))
                    if delta or logprobs is not None:
                        yield chunk(c.index, DeltaMessage(content=delta), logprobs=logprobs)
                    if c.finish_reason is not None:
                        finished.add(c.index)
                        yield chunk(c.index, DeltaMessage(), c.finish_reason,
                                    stop_reason=getattr(c, "stop_reason", None))
            if request.stream_options and request.stream_options.include_usage:
                yield sse(ChatCompletionStreamResponse(
                    id=request_id, created=created, model=self.model_name, choices=[],
                    usage=usage(len(prompt_ids), sum(counts.values()))))
        except EngineDeadError as error:
            yield sse(error_body(f"the engine failed while generating: {error}",
                                 "InternalServerError", 500))
        except RequestFailedError as error:
            yield sse(error_body(str(error), "InternalServerError", 500))
        finally:
            self._abort_unfinished([stream])
        yield sse("[DONE]")

    # ---- /tokenize, /detokenize --------------------------------------------------------------
    def tokenize(self, request: TokenizeRequest) -> dict:
        self.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise APIError("send exactly one of `prompt` or `messages`", 400, "prompt")
        if request.messages is not None:
            messages = [m.model_dump() for m in request.messages]
            try:
                text = apply_chat_template(self.tokenizer, messages)
            except ValueError as error:
                raise APIError(str(error), 400, "messages") from error
        else:
            text = request.prompt
            self.check_text_length(text)
        ids = encode(self.tokenizer, text, request.add_special_tokens)
        strs = [self.tokenizer.decode([t]) for t in ids] if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids,
                                token_strs=strs).model_dump()

    def detokenize(self, request: DetokenizeRequest) -> dict:
        self.check_model(request.model)
        vocab = getattr(self.tokenizer, "vocab_size", None)
        bad = [t for t in request.tokens if t < 0 or (isinstance(vocab, int) and t >= vocab)]
        if bad:
            raise APIError(f"tokens {bad[:5]} are outside the vocabulary [0, {vocab})", 400,
                           "tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens)).model_dump()
