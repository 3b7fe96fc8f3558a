"""DeepSeek multi-token-prediction (next-n) layer as an autoregressive drafter.

One next-n layer: x = eh_proj([enorm(embed(token)) ; hnorm(previous hidden)]), a full DeepSeek
decoder layer (index num_hidden_layers, so MoE like the target's deep layers), then shared_head.norm;
shared_head.head is the target's LM head. Checkpoint names follow DeepSeek-V3:
model.layers.{num_hidden_layers + k}.{enorm,hnorm,eh_proj,shared_head.norm,self_attn.*,mlp.*,...}.
"""
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


class SharedHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DeepSeekMultiTokenPredictorLayer(DeepseekV3DecoderLayer):
    def __init__(self, config, layer_idx: int, *, prefix: str, attention_backend: str):
        super().__init__(config, layer_idx, prefix=prefix, attention_backend=attention_backend)
        self.enorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * config.hidden_size, config.hidden_size)
        self.shared_head = SharedHead(config)

    def predict(self, positions, input_embeds, previous_hidden) -> tuple[torch.Tensor, torch.Tensor]:
        # Position 0 has no previous token: DeepSeek zeroes its embedding.
        input_embeds = torch.where(positions.unsqueeze(-1) == 0, torch.zeros_like(input_embeds), input_embeds)
        x = self.eh_proj(torch.cat([self.enorm(input_embeds), self.hnorm(previous_hidden)], dim=-1))
        x, residual = DeepseekV3DecoderLayer.forward(self, positions, x, None)
        return self.shared_head.norm(x, residual)  # (norm(x + residual), x + residual)


class MTPModel(nn.Module):
    def __init__(self, config, *, prefix: str, attention_backend: str):
        super().__init__()
        n = config.num_hidden_layers
        num_mtp = config.num_nextn_predict_layers
        if num_mtp < 1:
            raise ValueError(f"MTP drafter config has num_nextn_predict_layers={num_mtp}; it needs >= 1")
        self.first_layer_idx = n
        self.layers = nn.ModuleDict({
            str(n + k): DeepSeekMultiTokenPredictorLayer(config, n + k, prefix=f"{prefix}.layers.{n + k}",
                                                         attention_backend=attention_backend)
            for k in range(num_mtp)})


class DeepSeekMTP(TargetSharingDrafter):
    def __init__(self, *, vllm_config=None, prefix: str = "", hf_config=None):
        super().__init__()
        self.config = drafter_config(vllm_config, hf_config)
        prefix = prefix or DEFAULT_DRAFT_PREFIX
        self.model = MTPModel(self.config, prefix=f"{prefix}.model",
                              attention_backend=attention_backend_name(vllm_config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor,
                spec_step_idx: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (shared_head-normed hidden for logits, pre-norm hidden fed to the next draft step)."""
        idx = self.model.first_layer_idx + spec_step_idx % len(self.model.layers)
        return self.model.layers[str(idx)].predict(positions, self.embed(input_ids), hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        n = self.config.num_hidden_layers

        def rename(name: str):
            # Reading a full DeepSeek checkpoint: skip the target's tensors (embed, norm, lm_head)
            # and its decoder layers 0..n-1.
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < n:
                return None
            return name

        return load_named_weights(self, weights, ignore=SHARED_WITH_TARGET, rename=rename)
