"""SpeculativeConfig: the drafter, parsed from the JSON users pass to --speculative-config."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from vllm.config._checks import check_choice, check_positive_int

SPECULATIVE_METHODS = ("eagle", "mtp", "dflash", "dspark")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
REJECTION_SAMPLE_METHODS = ("strict", "probabilistic")
# Upstream spellings of the rejection methods -> ours. Upstream's "standard" is speculative
# (probabilistic) rejection sampling; "strict" was upstream's earlier name for exact matching of
# the target's own sample and stays as is.
_REJECTION_ALIASES = {"standard": "probabilistic"}
# Upstream methods this engine does not implement: refused with the reason.
_UNSUPPORTED_REJECTION = {
    "synthetic": "it fakes the acceptance rate for benchmarking and changes the output",
    "block": "block verification is not implemented",
}


@dataclass
class SpeculativeConfig:
    method: str
    model: str | None  # drafter directory; None = the built-in tiny drafter of `method`
    num_speculative_tokens: int
    draft_sample_method: str = "greedy"
    rejection_sample_method: str = "strict"

    def __post_init__(self):
        self.method = check_choice("method", self.method, SPECULATIVE_METHODS)
        if self.model is not None and not isinstance(self.model, str):
            self.model = str(self.model)  # accept pathlib.Path
        check_positive_int("num_speculative_tokens", self.num_speculative_tokens)
        self.draft_sample_method = check_choice("draft_sample_method", self.draft_sample_method,
                                                DRAFT_SAMPLE_METHODS)
        method = self.rejection_sample_method
        if isinstance(method, str) and method.lower() in _UNSUPPORTED_REJECTION:
            raise ValueError(f"rejection_sample_method={method!r} is not supported: "
                             f"{_UNSUPPORTED_REJECTION[method.lower()]}; use 'standard' "
                             "(= 'probabilistic') or 'strict'.")
        if isinstance(method, str):
            method = _REJECTION_ALIASES.get(method.lower(), method)
        self.rejection_sample_method = check_choice(
            "rejection_sample_method", method,
            REJECTION_SAMPLE_METHODS + tuple(_REJECTION_ALIASES))

    @property
    def uses_block_drafter(self) -> bool:
        """DFlash/DSpark draft a whole non-causal block per step; EAGLE/MTP go token by token."""
        return self.method in ("dflash", "dspark")

    @classmethod
    def from_json(cls, value: str | dict[str, Any]) -> "SpeculativeConfig":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"--speculative-config is not valid JSON: {e.msg} at line {e.lineno} column "
                    f"{e.colno} (char {e.pos}); expected e.g. "
                    '\'{"method": "dspark", "num_speculative_tokens": 4}\'.') from None
        if not isinstance(value, dict):
            raise ValueError(f"--speculative-config must be a JSON object, got {type(value).__name__}.")
        known = [f.name for f in fields(cls)]
        for key in value:
            if key not in known:
                raise ValueError(f"--speculative-config has unknown key {key!r}: allowed keys are "
                                 f"{known}.")
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ValueError(f"--speculative-config is missing required key {key!r}.")
        return cls(**{"model": None, **value})

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
