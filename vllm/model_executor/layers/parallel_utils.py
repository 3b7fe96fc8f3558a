"""Access to the TP / DCP process groups that also works when none was initialised (1 rank)."""
from __future__ import annotations

import torch


class SingleRankGroup:
    """Stand-in group for a single process: every collective is the identity."""

    world_size = 1
    rank_in_group = 0
    ranks = [0]
    device_group = None

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return t

    def reduce_scatter(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return t

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t


_SINGLE = SingleRankGroup()


def _group_or_single(getter_name: str):
    try:
        from vllm.distributed import parallel_state
    except ImportError:
        return _SINGLE
    getter = getattr(parallel_state, getter_name, None)
    if getter is None:
        return _SINGLE
    try:
        group = getter()
    except (AssertionError, RuntimeError, ValueError):
        # Groups not initialised: a single-process run (unit tests, tiny-model writer).
        return _SINGLE
    return _SINGLE if group is None else group


def tp_group():
    return _group_or_single("get_tp_group")


def dcp_group():
    return _group_or_single("get_dcp_group")


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(
            f"{what} = {numerator} is not divisible by the tensor-parallel size {denominator}; "
            f"choose a tensor_parallel_size that divides {numerator}"
        )
    return numerator // denominator
