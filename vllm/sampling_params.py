"""Per-request sampling parameters, validated at construction (ValueError names field and range)."""
from __future__ import annotations

import math
from dataclasses import dataclass

# Below this temperature sampling is treated as greedy (argmax), as upstream does.
_GREEDY_TEMPERATURE = 1e-5

# Bounds of the integers that reach tensors / numpy buffers in the runner: counts and positions
# live in int32 buffers, token ids, top-k and seeds in int64 ones (torch.Generator.manual_seed
# takes int64). A value outside its bound would raise inside engine.step(), where it would hit
# every request of the batch; here it is one request's ValueError. The API edge
# (entrypoints/openai/protocol.py) uses the same constants.
INT32_MAX = 2**31 - 1
INT64_MIN = -2**63
INT64_MAX = 2**63 - 1
# n fans out into n engine requests; beyond this one request would occupy the whole batch.
MAX_N = 1024
# Stop strings / bad words / token-id lists are scanned per step; keep one request's share bounded.
MAX_LIST_LEN = 1024


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
        _check_int("n", self.n, 1, MAX_N)
        _check_float("temperature", self.temperature, 0.0, None, "(0 = greedy)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} is invalid: it must be in (0, 1].")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT32_MAX:
            raise ValueError(f"top_k={self.top_k!r} is invalid: it must be -1, 0 (both = off) or "
                             f"an int in [1, {INT32_MAX}].")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, INT32_MAX,
                       "(or None = up to max_model_len)")
        _check_int("min_tokens", self.min_tokens, 0, INT32_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} is invalid: it must be <= "
                             f"max_tokens={self.max_tokens}.")
        if self.seed is not None:
            # n > 1 gives sample i the seed seed + i, which must still fit int64.
            _check_int("seed", self.seed, INT64_MIN, INT64_MAX - (self.n - 1), "or None")
        _check_len("stop", self.stop)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop entry {s!r} is invalid: stop strings must be non-empty str.")
        _check_token_ids("stop_token_ids", self.stop_token_ids)
        for name in ("ignore_eos", "detokenize", "skip_special_tokens",
                     "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: it must be a bool.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not -1 <= value <= INT32_MAX):
                raise ValueError(f"{name}={value!r} is invalid: it must be an int in "
                                 f"[0, {INT32_MAX}], -1 (the whole vocabulary) or None.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name}={value!r} is invalid: it must be a float in [-2, 2].")
        if not _is_number(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r} is invalid: it must "
                             "be a finite float > 0 (1 = off).")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p!r} is invalid: it must be a float in [0, 1].")
        if self.logit_bias is not None and len(self.logit_bias) > MAX_LIST_LEN:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries: at most "
                             f"{MAX_LIST_LEN} are allowed.")
        for token, bias in (self.logit_bias or {}).items():
            if not 0 <= token <= INT64_MAX or not math.isfinite(bias):
                raise ValueError(f"logit_bias entry {token}: {bias} is invalid: token ids are "
                                 f"ints in [0, {INT64_MAX}] and biases finite floats.")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids=[] is invalid: give at least one token id "
                                 "(or None = all tokens).")
            # The allowed set becomes a vocabulary-sized mask, so its length is not capped.
            _check_token_ids("allowed_token_ids", self.allowed_token_ids, cap=False)
        _check_len("bad_words", self.bad_words or ())
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


def _check_int(name: str, value, low: int, high: int, note: str = "") -> None:
    if not _is_int(value) or not low <= value <= high:
        note = f" {note}" if note else ""
        raise ValueError(f"{name}={value!r} is invalid: it must be an int in [{low}, {high}]"
                         f"{note}.")


def _check_float(name: str, value, low: float, high: float | None, note: str = "") -> None:
    if not _is_number(value) or value < low or (high is not None and value > high):
        upper = f"{high}]" if high is not None else "inf)"
        note = f" {note}" if note else ""
        raise ValueError(f"{name}={value!r} is invalid: it must be a finite float in "
                         f"[{low}, {upper}{note}.")


def _check_len(name: str, values) -> None:
    if len(values) > MAX_LIST_LEN:
        raise ValueError(f"{name} has {len(values)} entries: at most {MAX_LIST_LEN} are allowed.")


def _check_token_ids(name: str, ids, cap: bool = True) -> None:
    if cap:
        _check_len(name, ids)
    for t in ids:
        if not _is_int(t) or not 0 <= t <= INT64_MAX:
            raise ValueError(f"{name} entry {t!r} is invalid: token ids are ints in "
                             f"[0, {INT64_MAX}].")
