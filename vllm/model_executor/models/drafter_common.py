"""What every drafter shares: its own config directory, the target-fit check, and the embedding /
LM head borrowed from the target (held outside the module tree, so they are neither loaded nor
counted twice)."""
from __future__ import annotations

import re

import torch
from torch import nn

from vllm.transformers_utils.config import load_hf_config

DEFAULT_DRAFT_PREFIX = "draft_model"  # keeps draft layer names apart from the target's "model.layers.i"

# Tensors a drafter checkpoint may carry but the drafter takes from the target instead.
SHARED_WITH_TARGET = re.compile(r"^(model\.embed_tokens\.weight|lm_head\.weight|.*shared_head\.head\.weight"
                                r"|model\.layers\.\d+\.embed_tokens\.weight)$")


def drafter_model_dir(vllm_config) -> str:
    spec = vllm_config.speculative_config
    if spec is None:
        raise ValueError("a drafter needs vllm_config.speculative_config; pass --speculative-config")
    if spec.model:
        return spec.model
    if spec.method == "mtp":  # DeepSeek ships its MTP layer inside the target checkpoint
        return vllm_config.model_config.model
    raise ValueError(f"speculative method {spec.method!r} needs a draft model directory in "
                     "speculative_config.model")


def drafter_config(vllm_config, hf_config):
    return hf_config if hf_config is not None else load_hf_config(drafter_model_dir(vllm_config))


class TargetSharingDrafter(nn.Module):
    """Base class: `share_target(target)` checks fit and borrows embedding + LM head."""

    config = None

    def __init__(self):
        super().__init__()
        self._shared: dict[str, nn.Module] = {}

    def check_target_fit(self, target_config) -> None:
        name = type(self).__name__
        want_hidden = self.config.get("target_hidden_size", self.config.hidden_size)
        if target_config.hidden_size != want_hidden:
            raise ValueError(f"{name} expects a target with hidden_size={want_hidden}, but the target "
                             f"has hidden_size={target_config.hidden_size}; use a drafter trained for this target")
        if target_config.hidden_size != self.config.hidden_size:
            raise ValueError(f"{name} has hidden_size={self.config.hidden_size} but shares the target's "
                             f"embedding of hidden_size={target_config.hidden_size}; the sizes must agree")
        if target_config.vocab_size != self.config.vocab_size:
            raise ValueError(f"{name} has vocab_size={self.config.vocab_size} but the target has "
                             f"vocab_size={target_config.vocab_size}; they must share one vocabulary")

    def share_target(self, target_model) -> None:
        self.check_target_fit(target_model.config)
        self._shared["embed_tokens"] = target_model.model.embed_tokens
        self._shared["lm_head"] = target_model.lm_head

    def _need_shared(self, key: str) -> nn.Module:
        if key not in self._shared:
            raise RuntimeError(f"{type(self).__name__} has no {key}: call share_target(target_model) first")
        return self._shared[key]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._need_shared("embed_tokens")(input_ids)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._need_shared("lm_head").compute_logits(hidden_states)
