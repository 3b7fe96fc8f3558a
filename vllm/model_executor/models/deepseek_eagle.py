"""EAGLE drafter for DeepSeek targets: one causal MLA decoder layer over
fc([enorm(embed(token)) ; hnorm(target hidden)])."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.models.deepseek_v3 import DeepseekV3DecoderLayer, attention_backend_name
from vllm.model_executor.models.drafter_common import (DEFAULT_DRAFT_PREFIX, SHARED_WITH_TARGET,
                                                       TargetSharingDrafter, drafter_config)
from vllm.model_executor.models.weight_loading import load_named_weights


class EagleModel(nn.Module):
    def __init__(self, config, *, prefix: str, attention_backend: str):
        super().__init__()
        target_hidden = config.get("target_hidden_size", config.hidden_size)
        self.fc = ReplicatedLinear(config.hidden_size + target_hidden, config.hidden_size)
        self.enorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hnorm = RMSNorm(target_hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(
            DeepseekV3DecoderLayer(config, i, prefix=f"{prefix}.layers.{i}", attention_backend=attention_backend)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DeepseekEagleForCausalLM(TargetSharingDrafter):
    def __init__(self, *, vllm_config=None, prefix: str = "", hf_config=None):
        super().__init__()
        self.config = drafter_config(vllm_config, hf_config)
        prefix = prefix or DEFAULT_DRAFT_PREFIX
        self.model = EagleModel(self.config, prefix=f"{prefix}.model",
                                attention_backend=attention_backend_name(vllm_config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (final-normed hidden for logits, pre-norm hidden fed to the next draft step)."""
        x = torch.cat([self.model.enorm(self.embed(input_ids)), self.model.hnorm(hidden_states)], dim=-1)
        x, residual = self.model.fc(x), None
        for layer in self.model.layers:
            x, residual = layer(positions, x, residual)
        return self.model.norm(x, residual)  # (norm(x + residual), x + residual)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_named_weights(self, weights, ignore=SHARED_WITH_TARGET)
