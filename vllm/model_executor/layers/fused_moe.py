"""DeepSeek mixture of experts: grouped top-k routing (sigmoid + correction bias "noaux_tc", or
softmax), tensor-parallel experts stored stacked, shared experts, one all-reduce for the sum.

The routed experts run through `moe_kernels.fused_experts` (a Triton grouped GEMM on CUDA, a
gathered batched mat-vec elsewhere): no host sync and no Python loop over experts."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.mlp import GatedMLP
from vllm.model_executor.layers.moe_kernels import fused_experts
from vllm.model_executor.layers.moe_routing import (MAX_ROUTE_TOKENS, fused_routing_enabled,
                                                    route_supported, route_triton)
from vllm.model_executor.layers.parallel_utils import divide, tp_group
from vllm.model_executor.layers.weight_utils import default_weight_loader, load_shard
from vllm.triton_utils import HAS_TRITON

# checkpoint projection of each expert -> (stacked parameter, part); part 0 = gate rows of w13,
# 1 = up rows of w13, 2 = the whole w2
_EXPERT_PARTS = (("gate_proj", "w13_weight", 0), ("up_proj", "w13_weight", 1), ("down_proj", "w2_weight", 2))


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


class StackedExperts(nn.Module):
    """All routed experts of one layer, TP-sharded like a dense MLP (gate/up by rows, down by
    columns): w13_weight [E, 2*I_local, D] (gate rows then up rows), w2_weight [E, D, I_local].

    Checkpoints keep one tensor per expert and projection (`experts.{e}.gate_proj.weight`, ...);
    each stacked parameter lists them in `checkpoint_names` (relative to this module) with the
    shard id (expert, part) its `weight_loader` takes, and `export_shard(shard_id)` gives the
    matching local slice back (for writing checkpoints, TP=1)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        group = tp_group()
        self.tp_size, self.tp_rank = group.world_size, group.rank_in_group
        self.num_experts = num_experts
        self.inter_local = divide(intermediate_size, self.tp_size, "moe_intermediate_size")
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.inter_local, hidden_size),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter_local), requires_grad=False)
        for name in ("w13_weight", "w2_weight"):
            param = getattr(self, name)
            param.weight_loader = self.weight_loader
            param.export_shard = self._local_slice
            param.checkpoint_names = [(f"{e}.{proj}.weight", (e, part)) for e in range(num_experts)
                                      for proj, pname, part in _EXPERT_PARTS if pname == name]

    def _local_slice(self, shard_id: tuple[int, int]) -> torch.Tensor:
        expert, part = shard_id
        if not (isinstance(expert, int) and 0 <= expert < self.num_experts and part in (0, 1, 2)):
            raise ValueError(f"expert shard id {shard_id!r} is invalid: want (expert in [0, "
                             f"{self.num_experts}), part in 0 gate / 1 up / 2 down)")
        if part == 2:
            return self.w2_weight[expert]
        return self.w13_weight[expert].narrow(0, part * self.inter_local, self.inter_local)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: tuple[int, int]) -> None:
        dst = self._local_slice(shard_id)
        # gate/up [I, D] are split by rows, down [D, I] by columns, as in GatedMLP
        load_shard(param, loaded, dim=1 if shard_id[1] == 2 else 0, rank=self.tp_rank, world=self.tp_size,
                   dst=dst)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                fused_align: bool = True) -> torch.Tensor:
        """Routed sum over each token's experts (this rank's partial sum under TP)."""
        return fused_experts(x, self.w13_weight, self.w2_weight, weights, ids,
                             fused_align=fused_align)


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
        # Routing and pair alignment in one Triton launch each on CUDA (moe_routing.py), where
        # the router's shape allows; VLLM_FUSED_MOE_ROUTING=0 keeps the torch forms.
        self.fused_routing = fused_routing_enabled()
        self._route_fits = route_supported(self.num_experts, self.top_k, self.num_groups,
                                           self.topk_groups, self.scoring_func)
        self.gate = MoERouter(config.hidden_size, self.num_experts,
                              with_bias=config.topk_method == "noaux_tc")
        # Each expert is split over TP like a dense MLP; partial sums are reduced once at the end.
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; DeepSeek models use 'silu'")
        self.experts = StackedExperts(self.num_experts, config.hidden_size, config.moe_intermediate_size)
        if config.n_shared_experts:
            self.shared_experts = GatedMLP(config.hidden_size,
                                           config.moe_intermediate_size * config.n_shared_experts,
                                           config.hidden_act, reduce_results=False)
        else:
            self.shared_experts = None

    def _kernels_on(self, x: torch.Tensor) -> bool:
        """moe_routing's kernels may run for this call: CUDA with Triton, the switch on (each
        kernel then has its own limits)."""
        return self.fused_routing and x.is_cuda and HAS_TRITON

    def routes_fused(self, x: torch.Tensor, kernels_on: bool | None = None) -> bool:
        """Whether this call routes with moe_routing's kernel: the kernels on, a router it
        serves, and a decode-sized call (a prefill keeps the torch form's temporaries)."""
        if kernels_on is None:
            kernels_on = self._kernels_on(x)
        return self.routes_fused_tokens(x.shape[0], kernels_on)

    def routes_fused_tokens(self, num_tokens: int, kernels_on: bool) -> bool:
        """routes_fused for a call of `num_tokens` tokens."""
        return kernels_on and self._route_fits and num_tokens <= MAX_ROUTE_TOKENS

    def route(self, x: torch.Tensor, kernels_on: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k]) of x's tokens; `kernels_on` as
        `_kernels_on` says (moe_warmup.py runs this as forward does)."""
        route = route_triton if self.routes_fused(x, kernels_on) else select_experts
        return route(
            self.gate(x), self.top_k, scoring_func=self.scoring_func,
            correction_bias=self.gate.e_score_correction_bias, num_groups=self.num_groups,
            topk_groups=self.topk_groups, renormalize=self.renormalize,
            routed_scaling_factor=self.routed_scaling_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self._kernels_on(x)
        weights, ids = self.route(x, fused)
        out = self.experts(x, weights, ids, fused_align=fused)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        group = tp_group()
        return group.all_reduce(out) if group.world_size > 1 else out
