"""Shape-checked copies of checkpoint tensors into (possibly sharded) parameters."""
from __future__ import annotations

import torch


class WeightShapeError(ValueError):
    """A checkpoint tensor's shape does not fit the parameter; the loader adds the tensor name."""


def check_full_shape(loaded: torch.Tensor, expected_full: tuple[int, ...]) -> None:
    if tuple(loaded.shape) != tuple(expected_full):
        raise WeightShapeError(
            f"checkpoint shape {tuple(loaded.shape)} != model shape {tuple(expected_full)}"
        )


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Unsharded parameter: shapes must match exactly."""
    check_full_shape(loaded, tuple(param.shape))
    with torch.no_grad():
        param.copy_(loaded.to(dtype=param.dtype, device=param.device))


def load_shard(param: torch.Tensor, loaded: torch.Tensor, *, dim: int, rank: int, world: int,
               dst: torch.Tensor | None = None) -> None:
    """Copy this rank's contiguous 1/world slice of `loaded` along `dim` into `dst` (default `param`)."""
    dst = param if dst is None else dst
    expected = list(dst.shape)
    expected[dim] *= world
    check_full_shape(loaded, tuple(expected))
    size = dst.shape[dim]
    piece = loaded.narrow(dim, rank * size, size)
    with torch.no_grad():
        dst.copy_(piece.to(dtype=dst.dtype, device=dst.device))
