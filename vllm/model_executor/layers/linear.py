"""Tensor-parallel linear layers that take full checkpoint weights and keep only their shard.

Column-parallel layers split the output features (the input is replicated on every rank and the
output stays sharded); row-parallel layers split the input features and all-reduce the output.
Each parameter carries a `weight_loader(param, full_tensor[, shard_id])` used by `load_weights`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.parallel_utils import divide, tp_group
from vllm.model_executor.layers.weight_utils import default_weight_loader, load_shard


class ReplicatedLinear(nn.Module):
    """Full weight on every rank (small projections such as q_a_proj / kv_a_proj_with_mqa)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size), requires_grad=False)
            self.bias.weight_loader = default_weight_loader
        else:
            self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(nn.Module):
    """Y_local = X W_local^T with W split along the output dim; output stays sharded."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        group = tp_group()
        self.tp_size, self.tp_rank = group.world_size, group.rank_in_group
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = divide(output_size, self.tp_size, "output features")
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.bias = None

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        load_shard(param, loaded, dim=0, rank=self.tp_rank, world=self.tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input stored as one matrix
    (gate_proj + up_proj -> gate_up_proj). Each checkpoint tensor loads with its shard_id."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        super().__init__(input_size, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)
        self.local_sizes = [divide(s, self.tp_size, "merged output features") for s in output_sizes]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:
            raise ValueError("MergedColumnParallelLinear weights load per shard; pass shard_id")
        offset = sum(self.local_sizes[:shard_id])
        dst = param.narrow(0, offset, self.local_sizes[shard_id])
        load_shard(param, loaded, dim=0, rank=self.tp_rank, world=self.tp_size, dst=dst)


class RowParallelLinear(nn.Module):
    """Y = all_reduce(X_local W_local^T) + b with W split along the input dim."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True):
        super().__init__()
        group = tp_group()
        self.tp_size, self.tp_rank = group.world_size, group.rank_in_group
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = divide(input_size, self.tp_size, "input features")
        self.reduce_results = reduce_results
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size), requires_grad=False)
            self.bias.weight_loader = default_weight_loader
        else:
            self.bias = None

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        load_shard(param, loaded, dim=1, rank=self.tp_rank, world=self.tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        if self.reduce_results and self.tp_size > 1:
            out = tp_group().all_reduce(out)
        if self.bias is not None:
            out = out + self.bias  # after the reduce, so the bias counts once
        return out
