"""RMSNorm, computed in float32 like DeepSeek / Hugging Face, optionally fused with the residual add.

`forward(x)` -> weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype) (Hugging Face's rounding order);
`forward(x, residual)` -> (rmsnorm(x + residual), x + residual), the sum rounded to the activation
dtype first (exactly what `h = h + sublayer(h)` then `norm(h)` gave before fusion).
`forward(x, residual, sum_out=view)` stores the sum into a caller's view (e.g. a column slice of a
wider buffer: the target's tapped residual streams, written in place by the norms that compute
them anyway, deepseek_v3.py) and returns that view as the sum.

On CUDA both run as one Triton kernel per call: one program per row, the row held in registers,
float32 math there and no float32 copy of the tensor in memory. Elsewhere: torch, same formula.
"""
from __future__ import annotations

import torch
from torch import nn

from vllm.triton_utils import HAS_TRITON, tl, triton  # noqa: F401


def _check_sum_out(x: torch.Tensor, residual: torch.Tensor | None,
                   sum_out: torch.Tensor | None) -> None:
    if sum_out is None:
        return
    if residual is None:
        raise ValueError("rms_norm: sum_out needs a residual (it receives x + residual)")
    # (promote_types only when the dtypes differ: it is a dispatched op, and this runs per
    # tapped layer in every step)
    dtype = x.dtype if x.dtype == residual.dtype else torch.promote_types(x.dtype, residual.dtype)
    if sum_out.shape != x.shape or sum_out.dtype != dtype:
        raise ValueError(f"rms_norm: sum_out {tuple(sum_out.shape)} {sum_out.dtype} must match the "
                         f"sum x + residual: {tuple(x.shape)} {dtype}")


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None, sum_out: torch.Tensor | None = None):
    """Reference semantics (and the CPU path)."""
    _check_sum_out(x, residual, sum_out)
    if residual is not None:
        x = x + residual
        if sum_out is not None:
            x = sum_out.copy_(x)
    x32 = x.float()
    normed = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed if residual is None else (normed, x)


if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(x_ptr, x_stride, res_ptr, res_stride, sum_ptr, sum_stride, w_ptr, out_ptr,
                         out_stride, n_cols, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
            # round the sum to the stream dtype before normalising, as the unfused add did
            x = (x.to(tl.float32) + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)
            tl.store(sum_ptr + row * sum_stride + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
        y = (xf * rstd).to(x.dtype)  # Hugging Face casts back before the weight multiply
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        out = w.to(tl.float32) * y.to(tl.float32)
        tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None, sum_out: torch.Tensor | None = None):
    """Same results as `rms_norm_torch` (up to float32 summation order), one launch."""
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}; "
                         "pass the residual stream of the same tokens")
    _check_sum_out(x, residual, sum_out)
    hidden = x.shape[-1]
    x2 = _rows(x)
    stream_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, stream_dtype), device=x.device)
    if residual is not None:
        r2 = _rows(residual)
        if sum_out is None:
            summed = torch.empty(x2.shape, dtype=stream_dtype, device=x.device)
        else:
            # rows of the caller's view, written in place: `view` never copies (it raises
            # where the rows cannot be addressed with one row stride); any row stride is fine
            summed = sum_out.view(-1, x.shape[-1])
            if summed.stride(-1) != 1:
                raise ValueError("rms_norm: sum_out must be a view with unit column stride")
    else:
        r2 = summed = x2  # unused by the kernel (HAS_RESIDUAL=False)
    block = triton.next_power_of_2(hidden)
    num_warps = 4 if block <= 1024 else (8 if block <= 4096 else 16)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, x2.stride(0), r2, r2.stride(0), summed, summed.stride(0), weight, out, out.stride(0),
            hidden, eps, HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps)
    out = out.view(x.shape)
    if residual is None:
        return out
    return out, (summed.view(x.shape) if sum_out is None else sum_out)


_MAX_TRITON_WIDTH = 32768


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                sum_out: torch.Tensor | None = None):
        """x [..., D] -> rmsnorm(x); with `residual`: (rmsnorm(x + residual), x + residual),
        the sum written into `sum_out` when given (and that view returned)."""
        if x.shape[-1] != self.weight.shape[0]:
            raise ValueError(f"RMSNorm of size {self.weight.shape[0]} got input with last dim {x.shape[-1]}")
        # one row per program held in registers: fine up to this width (DeepSeek's widest is 7168)
        if HAS_TRITON and x.is_cuda and x.dtype != torch.float64 and x.shape[-1] <= _MAX_TRITON_WIDTH:
            return rms_norm_triton(x, self.weight, self.variance_epsilon, residual, sum_out)
        return rms_norm_torch(x, self.weight, self.variance_epsilon, residual, sum_out)
