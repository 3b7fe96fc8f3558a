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
        x, residual = self.input_norm(hidden_states, residual)
        return self.forward_normed(positions, x, residual)

    def input_norm(self, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                   sum_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm of the residual stream entering this layer, that stream). The stream is the
        previous layer's (mlp output + residual), summed here by the fused add + RMSNorm; with
        `sum_out` the sum is written there (a tapped layer's slice of the aux buffer)."""
        if residual is None:
            return self.input_layernorm(hidden_states), hidden_states
        return self.input_layernorm(hidden_states, residual, sum_out=sum_out)

    def forward_normed(self, positions: torch.Tensor, x: torch.Tensor,
                       residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer after its input norm: attention, post-attention norm, MLP."""
        hidden_states = self.self_attn(positions, x)
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
        """(final-normed hidden states, aux) where aux is [T, J * hidden]: the residual stream
        after each tapped layer (J of them, in layer order), side by side.

        Why one buffer: the stream after layer i is the sum that the NEXT norm (layer i + 1's
        input norm, or the final norm) computes anyway, so that norm writes it straight into
        its column slice. Tapping costs no add kernel per tapped layer and no concatenation
        (the block drafters' context write and EAGLE read the side-by-side layout), and the
        values are the sums the norms compute (the same rounding as `hidden + residual`)."""
        hidden_states, residual = self.embed_tokens(input_ids), None
        taps = sorted(set(aux_hidden_state_layers))
        aux = None
        slices: dict[int, torch.Tensor] = {}
        if taps:
            width = hidden_states.shape[-1]
            aux = hidden_states.new_empty(hidden_states.shape[:-1] + (len(taps) * width,))
            # the stream after layer i is summed by norm i + 1 (the final norm after the last)
            slices = {i + 1: aux[..., j * width:(j + 1) * width] for j, i in enumerate(taps)}
        for i, layer in enumerate(self.layers):
            x, residual = layer.input_norm(hidden_states, residual, sum_out=slices.get(i))
            hidden_states, residual = layer.forward_normed(positions, x, residual)
        normed, _ = self.norm(hidden_states, residual, sum_out=slices.get(len(self.layers)))
        return normed, aux


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
        """hidden [T, D]; with aux_hidden_state_layers: (hidden, aux [T, J * D]), the residual
        stream after each distinct tapped layer in increasing layer order, side by side (split
        it with `aux.split(D, dim=-1)` for per-layer views)."""
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
