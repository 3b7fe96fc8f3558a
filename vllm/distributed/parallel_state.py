"""Tensor-parallel (TP) and decode-context-parallel (DCP) process groups.

DCP reuses the TP ranks (DESIGN §4): the DCP groups are consecutive blocks of
TP ranks (tp=4, dcp=2 -> {0,1}, {2,3}), so `tp % dcp == 0` is required.
With world size 1 nothing needs to be initialised: every getter returns a
trivial single-rank group whose collectives are the identity.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class GroupCoordinator:
    """One process group plus the collectives attention needs on it."""

    world_size: int = 1
    rank_in_group: int = 0
    ranks: list[int] = field(default_factory=lambda: [0])
    device_group: object | None = None  # torch.distributed ProcessGroup, None when single-rank

    @property
    def is_gloo(self) -> bool:
        return (self.device_group is not None
                and dist.get_backend(self.device_group) == dist.Backend.GLOO)

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `tensor` along `dim` (rank order)."""
        if self.world_size == 1:
            return tensor
        dim = dim % tensor.dim()
        contiguous = tensor.contiguous()
        if self.is_gloo:
            parts = [torch.empty_like(contiguous) for _ in range(self.world_size)]
            dist.all_gather(parts, contiguous, group=self.device_group)
            return torch.cat(parts, dim=dim)
        # NCCL gathers along dim 0 into one buffer; move the wanted dim afterwards.
        gathered = torch.empty((self.world_size,) + tuple(contiguous.shape),
                               dtype=contiguous.dtype, device=contiguous.device)
        dist.all_gather_into_tensor(gathered, contiguous, group=self.device_group)
        # [N, ..., d, ...] -> concat of the N shards along `dim`
        return torch.cat(gathered.unbind(0), dim=dim)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum over ranks, then keep this rank's equal slice along `dim`."""
        if self.world_size == 1:
            return tensor
        dim = dim % tensor.dim()
        size = tensor.shape[dim]
        if size % self.world_size != 0:
            raise ValueError(
                f"reduce_scatter: dim {dim} has size {size}, not divisible by the group "
                f"size {self.world_size}; pad the tensor to a multiple of {self.world_size}.")
        chunk = size // self.world_size
        if self.is_gloo:
            # gloo has no reduce_scatter: all-reduce then slice (fine for CPU tests).
            summed = tensor.contiguous().clone()
            dist.all_reduce(summed, group=self.device_group)
            return summed.narrow(dim, self.rank_in_group * chunk, chunk).contiguous()
        moved = tensor.movedim(dim, 0).contiguous()
        out = torch.empty((chunk,) + tuple(moved.shape[1:]), dtype=moved.dtype,
                          device=moved.device)
        dist.reduce_scatter_tensor(out, moved, group=self.device_group)
        return out.movedim(0, dim).contiguous()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (returns a new tensor; the input is not modified)."""
        if self.world_size == 1:
            return tensor
        out = tensor.contiguous().clone()
        dist.all_reduce(out, group=self.device_group)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.device_group)


_SINGLE = GroupCoordinator()
_WORLD: GroupCoordinator | None = None
_TP: GroupCoordinator | None = None
_DCP: GroupCoordinator | None = None


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed_environment(world_size: int = 1, rank: int = 0,
                                 backend: str | None = None,
                                 init_method: str | None = None) -> None:
    """Start torch.distributed (skipped for world size 1). NCCL on CUDA, gloo on CPU."""
    global _WORLD
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"init_distributed_environment: need 0 <= rank < world_size, got "
                         f"rank={rank}, world_size={world_size}.")
    if world_size == 1:
        _WORLD = GroupCoordinator()
        return
    if backend in (None, "auto"):
        backend = _default_backend()
    if not dist.is_initialized():
        if init_method is None:
            if "MASTER_ADDR" not in os.environ:
                raise ValueError("init_distributed_environment: pass init_method "
                                 "(tcp://host:port or file://path) or set MASTER_ADDR/PORT.")
            init_method = "env://"
        dist.init_process_group(backend=backend, init_method=init_method,
                                world_size=world_size, rank=rank)
    _WORLD = GroupCoordinator(world_size, rank, list(range(world_size)), dist.group.WORLD)


def initialize_model_parallel(tensor_parallel_size: int = 1,
                              decode_context_parallel_size: int = 1) -> None:
    """Create the TP group (all ranks) and the DCP sub-groups of TP."""
    global _TP, _DCP
    tp, dcp = tensor_parallel_size, decode_context_parallel_size
    if dcp < 1 or tp % dcp != 0:
        raise ValueError(f"decode_context_parallel_size={dcp} must divide "
                         f"tensor_parallel_size={tp} (DCP reuses TP ranks).")
    world = _WORLD if _WORLD is not None else GroupCoordinator()
    if world.world_size != tp:
        raise ValueError(f"tensor_parallel_size={tp} must equal the world size "
                         f"{world.world_size}; call init_distributed_environment first.")
    if tp == 1:
        _TP, _DCP = GroupCoordinator(), GroupCoordinator()
        return
    rank = world.rank_in_group
    _TP = GroupCoordinator(tp, rank, list(range(tp)), world.device_group)
    _DCP = None
    # Every rank must create every group, in the same order.
    for start in range(0, tp, dcp):
        ranks = list(range(start, start + dcp))
        group = dist.new_group(ranks) if dcp > 1 else None
        if rank in ranks:
            _DCP = GroupCoordinator(dcp, ranks.index(rank), ranks, group)
    assert _DCP is not None


def get_world_group() -> GroupCoordinator:
    return _WORLD if _WORLD is not None else _SINGLE


def get_tp_group() -> GroupCoordinator:
    return _TP if _TP is not None else _SINGLE


def get_dcp_group() -> GroupCoordinator:
    return _DCP if _DCP is not None else _SINGLE


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank_in_group


def get_decode_context_model_parallel_world_size() -> int:
    return get_dcp_group().world_size


def get_decode_context_model_parallel_rank() -> int:
    return get_dcp_group().rank_in_group


def model_parallel_is_initialized() -> bool:
    return _TP is not None


def destroy_model_parallel() -> None:
    global _TP, _DCP
    for group in (_DCP,):
        if group is not None and group.device_group is not None and dist.is_initialized():
            dist.destroy_process_group(group.device_group)
    _TP, _DCP = None, None


def destroy_distributed_environment() -> None:
    global _WORLD
    destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    _WORLD = None
