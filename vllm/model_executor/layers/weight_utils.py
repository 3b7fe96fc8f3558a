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


def _check_not_requantizing(loaded: torch.Tensor, dst: torch.Tensor) -> None:
    # A plain cast to float8 would drop the block scales: the loader quantises first.
    if dst.dtype == torch.float8_e4m3fn and loaded.dtype != torch.float8_e4m3fn:
        raise WeightShapeError(f"an fp8 parameter received a {loaded.dtype} tensor; unquantised "
                               "weights must be block-quantised before loading")


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Unsharded parameter: shapes must match exactly."""
    check_full_shape(loaded, tuple(param.shape))
    _check_not_requantizing(loaded, param)
    with torch.no_grad():
        param.copy_(loaded.to(dtype=param.dtype, device=param.device))


def load_shard(param: torch.Tensor, loaded: torch.Tensor, *, dim: int, rank: int, world: int,
               dst: torch.Tensor | None = None) -> None:
    """Copy this rank's contiguous 1/world slice of `loaded` along `dim` into `dst` (default `param`)."""
    dst = param if dst is None else dst
    expected = list(dst.shape)
    expected[dim] *= world
    check_full_shape(loaded, tuple(expected))
    _check_not_requantizing(loaded, dst)
    size = dst.shape[dim]
    piece = loaded.narrow(dim, rank * size, size)
    with torch.no_grad():
        dst.copy_(piece.to(dtype=dst.dtype, device=dst.device))
