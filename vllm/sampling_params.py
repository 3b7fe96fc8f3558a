"""Per-request sampling parameters, validated at construction (ValueError names field and range)."""
from __future__ import annotations

from dataclasses import dataclass

# Below this temperature sampling is treated as greedy (argmax), as upstream does.
_GREEDY_TEMPERATURE = 1e-5


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
    logprobs: int | None = None
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
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs={self.logprobs!r} is invalid: it must be an int >= 0 "
                             "or None.")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_TEMPERATURE

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0
