"""SiLU-gated MLP (DeepSeek dense MLP, shared experts, each routed expert), tensor-parallel."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear

# checkpoint name -> (parameter name, shard id); gate_proj/up_proj are stored fused as gate_up_proj
GATE_UP_STACKED_PARAMS = (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu",
                 reduce_results: bool = True):
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act {hidden_act!r} is not supported; DeepSeek models use 'silu'")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, reduce_results=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
