"""DeepSeek mixture of experts in plain torch: grouped top-k routing (sigmoid + correction bias
"noaux_tc", or softmax), tensor-parallel experts, shared experts, one all-reduce for the sum."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.mlp import GatedMLP
from vllm.model_executor.layers.parallel_utils import tp_group
from vllm.model_executor.layers.weight_utils import default_weight_loader


def select_experts(router_logits: torch.Tensor, top_k: int, *, scoring_func: str,
                   correction_bias: torch.Tensor | None, num_groups: int, topk_groups: int,
                   renormalize: bool, routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (weights [T, k] float32, expert ids [T, k]) as DeepSeek routes.

    Experts are chosen on score + correction bias (the bias only steers the choice); the weights
    come from the unbiased scores. Group-limited routing keeps the `topk_groups` best groups,
    a group scoring as the sum of its two best experts (one best when groups hold one expert).
    """
    logits = router_logits.float()
    if scoring_func == "sigmoid":
        scores = logits.sigmoid()
    elif scoring_func == "softmax":
        scores = logits.softmax(dim=-1)
    else:
        raise ValueError(f"scoring_func {scoring_func!r} is not supported; use 'sigmoid' or 'softmax'")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    num_experts = choice.shape[-1]
    if num_groups > 1:
        grouped = choice.view(-1, num_groups, num_experts // num_groups)
        best = min(2, grouped.shape[-1])
        group_scores = grouped.topk(best, dim=-1)[0].sum(dim=-1)
        keep = torch.zeros_like(group_scores)
        keep.scatter_(1, group_scores.topk(topk_groups, dim=-1)[1], 1.0)
        expert_mask = keep.unsqueeze(-1).expand_as(grouped).reshape(-1, num_experts).bool()
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = choice.topk(top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


class MoERouter(nn.Module):
    """`mlp.gate.weight` [E, D] and `mlp.gate.e_score_correction_bias` [E]; kept in float32."""

    def __init__(self, hidden_size: int, num_experts: int, with_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        if with_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                        requires_grad=False)
            self.e_score_correction_bias.weight_loader = default_weight_loader
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class DeepseekMoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.n_routed_experts
        if self.num_experts % config.n_group:
            raise ValueError(f"n_routed_experts={self.num_experts} is not divisible by n_group={config.n_group}")
        self.scoring_func = config.scoring_func
        self.num_groups, self.topk_groups = config.n_group, config.topk_group
        self.renormalize = bool(config.norm_topk_prob)
        self.routed_scaling_factor = float(config.routed_scaling_factor)
        self.gate = MoERouter(config.hidden_size, self.num_experts,
                              with_bias=config.topk_method == "noaux_tc")
        # Each expert is split over TP like a dense MLP; partial sums are reduced once at the end.
        self.experts = nn.ModuleList(
            GatedMLP(config.hidden_size, config.moe_intermediate_size, config.hidden_act, reduce_results=False)
            for _ in range(self.num_experts)
        )
        if config.n_shared_experts:
            self.shared_experts = GatedMLP(config.hidden_size,
                                           config.moe_intermediate_size * config.n_shared_experts,
                                           config.hidden_act, reduce_results=False)
        else:
            self.shared_experts = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(
            self.gate(x), self.top_k, scoring_func=self.scoring_func,
            correction_bias=self.gate.e_score_correction_bias, num_groups=self.num_groups,
            topk_groups=self.topk_groups, renormalize=self.renormalize,
            routed_scaling_factor=self.routed_scaling_factor)
        out = torch.zeros_like(x)
        # Group the (token, slot) pairs by expert with one stable sort: each expert's rows come out in
        # token order, and the per-expert counts cost one host sync per layer (not one per expert).
        flat_ids = ids.flatten()
        order = flat_ids.argsort(stable=True)
        token_of = order // ids.shape[-1]
        weight_of = weights.flatten()[order].to(x.dtype)
        start = 0
        for expert_id, count in enumerate(torch.bincount(flat_ids, minlength=self.num_experts).tolist()):
            if count == 0:
                continue
            token_idx = token_of[start:start + count]
            expert_out = self.experts[expert_id](x[token_idx])
            out.index_add_(0, token_idx, expert_out * weight_of[start:start + count, None])
            start += count
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        group = tp_group()
        return group.all_reduce(out) if group.world_size > 1 else out
