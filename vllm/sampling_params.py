"""Per-request sampling parameters, validated at construction (ValueError names field and range)."""
from __future__ import annotations

import math
from dataclasses import dataclass

# Below this temperature sampling is treated as greedy (argmax), as upstream does.
_GREEDY_TEMPERATURE = 1e-5


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    max_tokens: int | None = 16
    min_tokens: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k target logprobs per output token (+ the sampled one)
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token (first one: None)
    # Logits processing (upstream names and semantics), applied on the device before sampling.
    presence_penalty: float = 0.0  # subtract once for every token already in the output
    frequency_penalty: float = 0.0  # subtract per occurrence in the output
    repetition_penalty: float = 1.0  # divide positive / multiply negative logits of seen tokens
    min_p: float = 0.0  # drop tokens with prob < min_p * max prob
    logit_bias: dict[int, float] | None = None  # token id -> added to the logit
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # words never generated
    # Output-text options (upstream names), read by the engine's detokenizer.
    detokenize: bool = True
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.logit_bias is not None:
            # JSON bodies carry the keys as strings ("50256": -100); upstream accepts both.
            try:
                self.logit_bias = {int(k): float(v) for k, v in dict(self.logit_bias).items()}
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias={self.logit_bias!r} is invalid: it must map token "
                                 "ids (int) to biases (float).") from None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        elif self.bad_words is not None:
            self.bad_words = list(self.bad_words)
        # Set by the engine (upstream: update_from_generation_config): EOS + stop_token_ids, the
        # ids that min_tokens keeps from being sampled; and the tokenized bad words.
        self._all_stop_token_ids: set[int] = set(self.stop_token_ids)
        self._bad_words_token_ids: list[list[int]] | None = None
        self._validate()

    def _validate(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n={self.n!r} is invalid: it must be an int >= 1.")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature!r} is invalid: it must be >= 0 "
                             "(0 = greedy).")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) \
                or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} is invalid: it must be in (0, 1].")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r} is invalid: it must be -1, 0 (both = off) or "
                             "a positive int.")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens={self.max_tokens!r} is invalid: it must be an int >= 1 "
                             "(or None = up to max_model_len).")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens={self.min_tokens!r} is invalid: it must be an int >= 0.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} is invalid: it must be <= "
                             f"max_tokens={self.max_tokens}.")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed={self.seed!r} is invalid: it must be an int or None.")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop entry {s!r} is invalid: stop strings must be non-empty str.")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids entry {t!r} is invalid: token ids are ints >= 0.")
        for name in ("ignore_eos", "detokenize", "skip_special_tokens",
                     "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: it must be a bool.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < -1):
                raise ValueError(f"{name}={value!r} is invalid: it must be an int >= 0, -1 (the "
                                 "whole vocabulary) or None.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name}={value!r} is invalid: it must be a float in [-2, 2].")
        if not _is_number(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r} is invalid: it must "
                             "be a float > 0 (1 = off).")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p!r} is invalid: it must be a float in [0, 1].")
        for token, bias in (self.logit_bias or {}).items():
            if token < 0 or not math.isfinite(bias):
                raise ValueError(f"logit_bias entry {token}: {bias} is invalid: token ids are "
                                 "ints >= 0 and biases finite floats.")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids=[] is invalid: give at least one token id "
                                 "(or None = all tokens).")
            for t in self.allowed_token_ids:
                if not _is_int(t) or t < 0:
                    raise ValueError(f"allowed_token_ids entry {t!r} is invalid: token ids are "
                                     "ints >= 0.")
        for w in self.bad_words or ():
            if not isinstance(w, str) or not w.strip():
                raise ValueError(f"bad_words entry {w!r} is invalid: give non-empty strings.")

    @property
    def all_stop_token_ids(self) -> set[int]:
        return self._all_stop_token_ids

    def update_from_tokenizer(self, eos_token_id: int | None, tokenizer=None) -> None:
        """Engine hook (upstream's update_from_generation_config + update_from_tokenizer): record
        the ids min_tokens must hold back and tokenize bad_words."""
        ids = set(self.stop_token_ids)
        if eos_token_id is not None and not self.ignore_eos:
            ids.add(int(eos_token_id))
        self._all_stop_token_ids = ids
        if self.bad_words and tokenizer is not None:
            seqs = []
            for word in self.bad_words:
                # Upstream bans the word both at the start of text and after a space.
                for variant in (word.lstrip(), " " + word.lstrip()):
                    ids_ = list(getattr(tokenizer.encode(variant, add_special_tokens=False),
                                        "ids", None) or tokenizer.encode(variant,
                                                                         add_special_tokens=False))
                    if ids_ and ids_ not in seqs:
                        seqs.append(ids_)
            self._bad_words_token_ids = seqs

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_TEMPERATURE

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0
