"""DeepSeek-V3-style decoder (MLA attention, dense MLP for the first k layers, then MoE)."""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from vllm.model_executor.layers.attention.mla_attention import MLAAttention
from vllm.model_executor.layers.fused_moe import DeepseekMoE
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.mlp import GatedMLP
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.weight_loading import load_named_weights


def attention_backend_name(vllm_config) -> str:
    if vllm_config is None or getattr(vllm_config, "model_config", None) is None:
        return "auto"
    return getattr(vllm_config.model_config, "attention_backend", "auto") or "auto"


def uses_moe(config, layer_idx: int) -> bool:
    return (config.n_routed_experts is not None and layer_idx >= config.first_k_dense_replace
            and layer_idx % config.moe_layer_freq == 0)


class DeepseekV3DecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)). `layer_idx` picks dense MLP vs MoE.

    As upstream vLLM, the residual stream travels separately: forward(positions, h, residual) ->
    (mlp output, residual), and the next norm adds them (fused add + RMSNorm, one kernel). The
    residual stream after the layer is their sum; the first layer passes residual=None."""

    def __init__(self, config, layer_idx: int, *, prefix: str, attention_backend: str = "auto",
                 non_causal: bool = False):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = MLAAttention(config, layer_name=f"{prefix}.self_attn",
                                      attention_backend=attention_backend, non_causal=non_causal)
        if uses_moe(config, layer_idx):
            self.mlp = DeepseekMoE(config)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class DeepseekV3Model(nn.Module):
    def __init__(self, config, *, prefix: str, attention_backend: str = "auto"):
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekV3DecoderLayer(config, i, prefix=f"{prefix}.layers.{i}", attention_backend=attention_backend)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, positions, aux_hidden_state_layers: tuple[int, ...] = ()):
        hidden_states, residual = self.embed_tokens(input_ids), None
        aux = []
        for i, layer in enumerate(self.layers):
            hidden_states, residual = layer(positions, hidden_states, residual)
            if i in aux_hidden_state_layers:
                aux.append(hidden_states + residual)  # the residual stream after layer i
        return self.norm(hidden_states, residual)[0], aux


class DeepseekV3ForCausalLM(nn.Module):
    """Target model. `forward` returns final-normed hidden states (plus the residual stream after
    each requested layer); `compute_logits` gives full-vocabulary logits on every TP rank."""

    def __init__(self, *, vllm_config=None, prefix: str = "", hf_config=None):
        super().__init__()
        config = hf_config if hf_config is not None else vllm_config.model_config.hf_config
        self.config = config
        self.vllm_config = vllm_config
        model_prefix = f"{prefix}.model" if prefix else "model"
        self.model = DeepseekV3Model(config, prefix=model_prefix,
                                     attention_backend=attention_backend_name(vllm_config))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                aux_hidden_state_layers: tuple[int, ...] = ()):
        bad = [i for i in aux_hidden_state_layers if not 0 <= i < self.config.num_hidden_layers]
        if bad:
            raise ValueError(f"aux_hidden_state_layers {bad} outside [0, {self.config.num_hidden_layers}); "
                             "pass decoder layer indices of this target")
        hidden, aux = self.model(input_ids, positions, tuple(aux_hidden_state_layers))
        return (hidden, aux) if aux_hidden_state_layers else hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def attention_layers(self) -> list[MLAAttention]:
        return [m for m in self.modules() if isinstance(m, MLAAttention)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        n = self.config.num_hidden_layers
        # Real DeepSeek checkpoints append the MTP next-n layer(s) as model.layers.{n..}: not ours.
        beyond = re.compile(r"model\.layers\.(\d+)\.")

        def rename(name: str):
            m = beyond.match(name)
            if m and int(m.group(1)) >= n:
                return None
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                return None
            return name

        return load_named_weights(self, weights, rename=rename)
