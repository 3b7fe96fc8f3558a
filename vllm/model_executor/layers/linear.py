"""Tensor-parallel linear layers that take full checkpoint weights and keep only their shard.

Column-parallel layers split the output features (the input is replicated on every rank and the
output stays sharded); row-parallel layers split the input features and all-reduce the output.
Each parameter carries a `weight_loader(param, full_tensor[, shard_id])` used by `load_weights`.

Quantisation hook: a quantisation method (layers/quantization) may replace `weight` with a
quantised parameter, add its scales (loaded by `scale_loader(block)`, sharded like the weight in
block units) and set `quant_method`; `forward` then calls `quant_method.apply(layer, x, bias)`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.parallel_utils import divide, tp_group
from vllm.model_executor.layers.weight_utils import default_weight_loader, load_shard


class LinearBase(nn.Module):
    """Shared by every linear layer: `quant_method` (None = plain F.linear) and which dim is
    sharded under TP (`shards_output` / `shards_input`), which quantisation needs for its scales."""

    shards_output = False
    shards_input = False
    quant_method = None
    tp_size, tp_rank = 1, 0

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, bias)
        return F.linear(x, self.weight, bias)

    def scale_loader(self, block: tuple[int, int]):
        """weight_loader for block scales [ceil(N/bn), ceil(K/bk)] of this layer's weight."""
        return default_weight_loader


class ReplicatedLinear(LinearBase):
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
        return self._matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Y_local = X W_local^T with W split along the output dim; output stays sharded."""

    shards_output = True

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

    def scale_loader(self, block):
        # Shards are block-aligned (checked when quantising), so scale rows shard like weight rows.
        return lambda param, loaded: load_shard(param, loaded, dim=0, rank=self.tp_rank, world=self.tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


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

    def scale_loader(self, block):
        bn = block[0]

        def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
            if shard_id is None:
                raise ValueError("MergedColumnParallelLinear scales load per shard; pass shard_id")
            # every projection is a whole number of blocks (checked when quantising)
            offset = sum(self.local_sizes[:shard_id]) // bn
            dst = param.narrow(0, offset, self.local_sizes[shard_id] // bn)
            load_shard(param, loaded, dim=0, rank=self.tp_rank, world=self.tp_size, dst=dst)
        return load


class RowParallelLinear(LinearBase):
    """Y = all_reduce(X_local W_local^T) + b with W split along the input dim."""

    shards_input = True

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

    def scale_loader(self, block):
        return lambda param, loaded: load_shard(param, loaded, dim=1, rank=self.tp_rank, world=self.tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(x, None)
        if self.reduce_results and self.tp_size > 1:
            out = tp_group().all_reduce(out)
        if self.bias is not None:
            out = out + self.bias  # after the reduce, so the bias counts once
        return out
