"""DFlash block drafter on MLA: K dense, non-causal MLA decoder layers that attend over
(context KV precomputed from tapped target hidden states) + (the draft block itself).

Context features = hidden_norm(fc(concat of target residual streams at config.target_layer_ids)).
Each draft layer turns them into its own latent KV (kv_a_proj -> kv_a_layernorm on c_kv, RoPE on
k_pe at the tokens' true positions) and stores them in its own paged cache (`precompute_context_kv`).
The block (anchor + mask tokens, embedded with the target's embedding) then runs through the layers;
each writes the block's KV before attending non-causally over context + block.
DFlash: block = anchor + N masks; the hidden state at a mask position predicts the token at it.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vllm.model_executor.layers.attention.mla_attention import current_attn_metadata
from vllm.model_executor.layers.attention.mla_context_kv_writer import (ContextKVWriter,
                                                                        fused_context_kv_enabled)
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.models.deepseek_v3 import DeepseekV3DecoderLayer, attention_backend_name
from vllm.model_executor.models.drafter_common import (DEFAULT_DRAFT_PREFIX, SHARED_WITH_TARGET,
                                                       TargetSharingDrafter, block_drafter_fields,
                                                       drafter_config)
from vllm.model_executor.models.weight_loading import load_named_weights


class BlockDrafterModel(nn.Module):
    def __init__(self, config, *, prefix: str, attention_backend: str, num_target_layers: int):
        super().__init__()
        target_hidden = config.get("target_hidden_size", config.hidden_size)
        self.fc = ReplicatedLinear(num_target_layers * target_hidden, config.hidden_size)
        self.hidden_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(
            DeepseekV3DecoderLayer(config, i, prefix=f"{prefix}.layers.{i}", attention_backend=attention_backend,
                                   non_causal=True)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DFlashMLAForCausalLM(TargetSharingDrafter):
    method = "dflash"

    def __init__(self, *, vllm_config=None, prefix: str = "", hf_config=None):
        super().__init__()
        self.config = drafter_config(vllm_config, hf_config)
        fields = block_drafter_fields(self.config, self.method)
        self.fields = fields
        self.target_layer_ids = fields.target_layer_ids
        self.block_size = fields.block_size
        self.mask_token_id = fields.mask_token_id
        # Canonical names on the config too (the speculator reads config.target_layer_ids /
        # mask_token_id), whichever upstream layout config.json used.
        self.config.target_layer_ids = list(fields.target_layer_ids)
        self.config.block_size = fields.block_size
        self.config.mask_token_id = fields.mask_token_id
        prefix = prefix or DEFAULT_DRAFT_PREFIX
        # VLLM_FUSED_DRAFT_CONTEXT_KV, read when the drafter is built (engines built under
        # other settings in one process keep theirs: benchmarks A/B them side by side)
        self.fused_context_kv = fused_context_kv_enabled()
        self.model = BlockDrafterModel(self.config, prefix=f"{prefix}.model",
                                       attention_backend=attention_backend_name(vllm_config),
                                       num_target_layers=len(self.target_layer_ids))

    def check_target_fit(self, target_config) -> None:
        layers = target_config.num_hidden_layers
        bad = [i for i in self.target_layer_ids if not 0 <= i < layers]
        if bad:
            raise ValueError(f"{type(self).__name__} taps target layers {list(self.target_layer_ids)} "
                             f"(target_layer_ids) but the target has num_hidden_layers={layers}; "
                             f"layers {bad} do not exist. Use a drafter trained for this target")
        super().check_target_fit(target_config)

    def context_features(self, target_aux_hidden: torch.Tensor) -> torch.Tensor:
        return self.model.hidden_norm(self.model.fc(target_aux_hidden))

    def precompute_context_kv(self, target_aux_hidden: torch.Tensor, positions: torch.Tensor) -> None:
        """Write every draft layer's latent KV of the context tokens through the slot mapping of
        that layer in the current forward context. target_aux_hidden [T, k*D], positions [T]."""
        features = self.context_features(target_aux_hidden)
        attns = [layer.self_attn for layer in self.model.layers]
        slots = []
        for attn in attns:
            metadata = current_attn_metadata(attn.layer_name)
            if metadata is None:
                raise RuntimeError(f"precompute_context_kv needs attention metadata (slot mapping) for "
                                   f"{attn.layer_name!r} in the forward context")
            slots.append(metadata.slot_mapping)
        # One GEMM and one launch for all layers where that is exact (mla_context_kv_writer.py).
        writer = self.__dict__.get("_context_kv_writer")
        if writer is None:
            writer = self.__dict__["_context_kv_writer"] = ContextKVWriter(
                attns, enabled=self.fused_context_kv)
        if writer.usable(features):
            writer.write(positions, features, slots)
            return
        for attn, slot_mapping in zip(attns, slots):
            attn.write_latent_kv(positions, features, slot_mapping)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed(input_ids), None
        for layer in self.model.layers:
            x, residual = layer(positions, x, residual)
        return self.model.norm(x, residual)[0]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_named_weights(self, weights, ignore=SHARED_WITH_TARGET)
