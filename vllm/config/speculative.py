"""SpeculativeConfig: the drafter, parsed from the JSON users pass to --speculative-config."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from vllm.config._checks import check_choice, check_positive_int, is_int

SPECULATIVE_METHODS = ("eagle", "mtp", "dflash", "dspark")
METHOD_ALIASES = {"deepseek_mtp": "mtp"}  # upstream's name for DeepSeek's MTP
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
    # None = inferred from the draft config (architectures / DFlash / DSpark keys)
    method: str | None = None
    # drafter directory; None = MTP: the target's own next-n layers (a user target) or the
    # built-in tiny drafter of `method` (the built-in tiny target)
    model: str | None = None
    # None = from the draft config: DFlash block_size - 1, DSpark block_size, MTP
    # num_nextn_predict_layers (resolved by resolve_from_draft_config)
    num_speculative_tokens: int | None = None
    draft_sample_method: str = "greedy"
    rejection_sample_method: str = "strict"
    # Upstream's key: stop drafting while N or more requests run (None: always draft). "auto":
    # a cost model drafts per request only while measured step times and the request's own
    # acceptance say drafting pays (vllm/v1/spec_decode/cost_model.py).
    disable_by_batch_size: int | str | None = None

    # ---- decoupled draft parallelism (upstream RFC #53673) ----
    # None = the target's tensor_parallel_size; only that value is implemented (the drafter
    # shards its heads over the target's TP ranks).
    draft_tensor_parallel_size: int | None = None
    # None = the target's decode_context_parallel_size. 1 under a DCP target: the drafter's KV
    # is REPLICATED on every rank (each rank drafts over the full context, no cross-rank merge).
    draft_decode_context_parallel_size: int | None = None

    def __post_init__(self):
        if self.model is not None and not isinstance(self.model, str):
            self.model = str(self.model)  # accept pathlib.Path
        if self.method is None:
            if self.model is None:
                raise ValueError("speculative_config needs a 'method' (one of "
                                 f"{list(SPECULATIVE_METHODS)}) or a draft 'model' to infer it from.")
        else:
            if isinstance(self.method, str):
                self.method = METHOD_ALIASES.get(self.method.lower(), self.method)
            self.method = check_choice("method", self.method, SPECULATIVE_METHODS)
        check_positive_int("num_speculative_tokens", self.num_speculative_tokens, optional=True)
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
        self.disable_by_batch_size = _check_disable_by_batch_size(self.disable_by_batch_size)
        check_positive_int("draft_tensor_parallel_size", self.draft_tensor_parallel_size,
                           optional=True)
        check_positive_int("draft_decode_context_parallel_size",
                           self.draft_decode_context_parallel_size, optional=True)

    def resolve_draft_parallelism(self, tensor_parallel_size: int,
                                  decode_context_parallel_size: int) -> None:
        """Default the drafter's TP / DCP sizes to the target's and refuse what is not served.
        Idempotent (VllmConfig may resolve twice)."""
        tp, dcp = int(tensor_parallel_size), int(decode_context_parallel_size)
        if self.draft_tensor_parallel_size is None:
            self.draft_tensor_parallel_size = tp
        if self.draft_tensor_parallel_size != tp:
            raise ValueError(
                f"draft_tensor_parallel_size={self.draft_tensor_parallel_size} is not implemented "
                f"with tensor_parallel_size={tp}: the drafter shards its heads over the target's TP "
                f"ranks; omit it or set it to {tp}.")
        if self.draft_decode_context_parallel_size is None:
            self.draft_decode_context_parallel_size = dcp
        if self.draft_decode_context_parallel_size not in (1, dcp) and dcp == 1:
            raise ValueError(
                f"draft_decode_context_parallel_size={self.draft_decode_context_parallel_size} is "
                "invalid with decode_context_parallel_size=1: the target does not split its KV, "
                "so neither can the drafter; omit it or set it to 1.")
        if self.draft_decode_context_parallel_size not in (1, dcp):
            raise ValueError(
                f"draft_decode_context_parallel_size={self.draft_decode_context_parallel_size} is "
                f"invalid with decode_context_parallel_size={dcp}: the draft KV is either sharded "
                f"like the target's ({dcp}) or replicated on every rank (1); set it to 1 or {dcp}.")

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
        if value.get("method") is None and value.get("model") is None:
            raise ValueError("--speculative-config needs 'method' (one of "
                             f"{list(SPECULATIVE_METHODS)}) or a draft 'model' to infer it from.")
        return cls(**value)

    def resolve_from_draft_config(self, draft_config) -> None:
        """Fill `method` / `num_speculative_tokens` from the drafter's config.json and refuse a
        k that the drafter's block cannot hold. `draft_config` is an HFConfig (for MTP inside the
        target: the target's)."""
        from vllm.model_executor.models.drafter_common import (block_drafter_fields,
                                                               expected_num_speculative_tokens)
        where = f"{getattr(draft_config, 'path', None) or self.model}/config.json"
        if self.method is None:
            self.method = infer_method(draft_config, where)
        if self.method in ("dflash", "dspark"):
            block = block_drafter_fields(draft_config, self.method).block_size
            capacity = expected_num_speculative_tokens(self.method, block)
            if self.num_speculative_tokens is None:
                self.num_speculative_tokens = capacity
            elif self.num_speculative_tokens > capacity:
                form = "block_size - 1 (anchor + masks)" if self.method == "dflash" else "block_size"
                raise ValueError(
                    f"num_speculative_tokens={self.num_speculative_tokens} does not fit the {self.method} "
                    f"drafter's block_size={block} ({where}): it drafts at most {form} = {capacity} tokens "
                    f"per step; set num_speculative_tokens <= {capacity} or omit it")
        elif self.method == "mtp" and self.num_speculative_tokens is None:
            # (with k given, the MTP model itself refuses a config without next-n layers at load)
            n = int(draft_config.get("num_nextn_predict_layers", 0) or 0)
            if n < 1:
                raise ValueError(f"speculative method 'mtp' reads the next-n layers of {where}, but it has "
                                 f"num_nextn_predict_layers={n}; use a checkpoint with MTP layers or set "
                                 "speculative_config.model to an MTP drafter")
            self.num_speculative_tokens = n
        elif self.num_speculative_tokens is None:
            raise ValueError(f"speculative method {self.method!r} needs num_speculative_tokens "
                             "(its draft config does not imply one)")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _check_disable_by_batch_size(value):
    """None, "auto" or an int N >= 1 (a digit string from dotted CLI keys counts as N).
    Upstream requires N >= 2; N = 1 is kept here as "never draft" (an A/B switch)."""
    if value is None or is_int(value) and value >= 1:
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return "auto"
        if text.isdigit() and int(text) >= 1:
            return int(text)
    raise ValueError(f"disable_by_batch_size={value!r} is invalid: use an int N >= 1 (no drafting "
                     "while N or more requests run), 'auto' (a cost model decides per request) "
                     "or null (always draft).")


def infer_method(draft_config, where: str = "config.json") -> str:
    """The speculative method a draft config.json describes (architectures and format keys)."""
    values = draft_config.to_dict()
    arch = " ".join(values.get("architectures") or []).lower()
    if "dspark" in arch or any(k.startswith("dspark_") for k in values) or "markov_rank" in values:
        return "dspark"
    if "dflash" in arch or "dflash_config" in values:
        return "dflash"
    if "eagle" in arch:
        return "eagle"
    if "mtp" in arch or int(values.get("num_nextn_predict_layers") or 0) > 0:
        return "mtp"
    raise ValueError(f"cannot infer the speculative method from {where} (architectures="
                     f"{values.get('architectures')}); set speculative_config.method to one of "
                     f"{list(SPECULATIVE_METHODS)}")
