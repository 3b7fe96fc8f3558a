"""Incremental detokenization with stop-string detection.

Decoding one token at a time is wrong for byte-level BPE (a character can span tokens) and for
tokenizers that drop a word's leading space at the start of a decode. So each step decodes a short
window that starts a few tokens back (`prefix_offset`) and emits only the text past the window's
already-emitted part (`read_offset`), holding back while the text ends in an incomplete character.
Tokenizers backed by the `tokenizers` library use its `DecodeStream` instead (same contract: text
appears once its characters are complete), primed with the same prompt context.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

# Prompt tokens used as decoding context for the first output tokens.
_CONTEXT_TOKENS = 5
_INCOMPLETE_CHAR = "\ufffd"


class IncrementalDetokenizer:

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True,
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._tokens: list[int] = context  # context + outputs
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.output_text = ""
        self.stopped = False
        self.num_consumed = 0  # tokens of the last update() up to its stop string (all: no stop)
        self._stream = None
        # With a DecodeStream and no stop strings, update() of one token is exactly
        # `delta = step_token(token)` then `output_text += delta` when delta is non-empty:
        # the engine calls this C-level step directly (None: call update()).
        self.step_token = None
        backend = getattr(tokenizer, "backend", None)
        if backend is not None:
            try:
                from tokenizers.decoders import DecodeStream
            except ImportError:  # older tokenizers: the windowed decode below
                DecodeStream = None
            if DecodeStream is not None:
                self._backend = backend
                self._stream = DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens)
                if not self.stop:
                    self.step_token = functools.partial(self._stream.step, backend)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Append tokens; return the stop string if one appeared (text is then cut at it).
        `num_consumed` is then how many of `new_token_ids` it took to complete the stop string:
        a speculative step emits several tokens, and the ones after the stop are not output
        (a plain engine, one token per step, never generates them)."""
        self.num_consumed = len(new_token_ids)
        if self.stopped:
            return None
        stream = self._stream
        if stream is not None:
            backend = self._backend
            if not self.stop:  # nothing to search for: just keep the text (the common case)
                for token in new_token_ids:
                    delta = stream.step(backend, int(token))
                    if delta:
                        self.output_text += delta
                return None
            for i, token in enumerate(new_token_ids):
                delta = stream.step(backend, int(token))
                if delta and self._append(delta):
                    self.num_consumed = i + 1
                    return self._matched
            return None
        for i, token in enumerate(new_token_ids):
            self._tokens.append(int(token))
            prefix_text = self._decode(self._tokens[self._prefix_offset:self._read_offset])
            full_text = self._decode(self._tokens[self._prefix_offset:])
            if len(full_text) <= len(prefix_text) or full_text.endswith(_INCOMPLETE_CHAR):
                continue  # nothing printable yet
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._tokens)
            if self._append(full_text[len(prefix_text):]):
                self.num_consumed = i + 1
                return self._matched
        return None

    def _append(self, delta: str) -> bool:
        """Add newly printable text; True (and `_matched` set) when a stop string completes."""
        self.output_text += delta
        self._matched = self._find_stop(len(delta))
        if self._matched is not None:
            self.stopped = True
            return True
        return False

    def _find_stop(self, new_chars: int) -> str | None:
        """Search only where a stop string could end inside the newly added text."""
        best = None
        for stop in self.stop:
            start = max(0, len(self.output_text) - new_chars - len(stop) + 1)
            index = self.output_text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        end = index + len(stop) if self.include_stop_str_in_output else index
        self.output_text = self.output_text[:end]
        return stop
