"""RMSNorm with and without the fused residual add: float64 reference on CPU, the Triton kernel
under the interpreter, and the kernel against the torch path on the GPU (sync-free, capturable)."""
from pathlib import Path

import pytest
import torch

from tests.utils.triton_interpreter import run_interpreter_driver
from vllm.model_executor.layers.layernorm import RMSNorm, rms_norm_torch

DRIVER = Path(__file__).parents[2].joinpath("utils", "triton_fused_ops_interpret_driver.py")


def _norm_float64(x, weight, eps):
    x = x.double()
    return weight.double() * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_float64_reference(with_residual):
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(96, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96, generator=gen) + 0.5)
    x = torch.randn(5, 96, generator=gen) * 3
    res = torch.randn(5, 96, generator=gen) if with_residual else None
    got = norm(x, res)
    if with_residual:
        got, summed = got
        assert torch.equal(summed, x + res)
        x = x + res
    torch.testing.assert_close(got.double(), _norm_float64(x, norm.weight, 1e-5), rtol=1e-6, atol=1e-6)


def test_fused_residual_equals_unfused_sequence_bf16():
    """(norm(x + r), x + r) is bit for bit what `h = x + r; norm(h)` gave before the fusion."""
    gen = torch.Generator().manual_seed(2)
    norm = RMSNorm(64).to(torch.bfloat16)
    x, r = (torch.randn(7, 64, generator=gen).bfloat16() for _ in range(2))
    out, summed = norm(x, r)
    assert torch.equal(summed, x + r) and torch.equal(out, norm(x + r))
    assert out.dtype == torch.bfloat16


def test_sum_out_receives_the_residual_stream_in_place():
    """`sum_out` (a column slice of a wider buffer) gets x + r exactly, the rest of the buffer is
    untouched, and the normed output is what the unfused norm gives."""
    gen = torch.Generator().manual_seed(4)
    norm = RMSNorm(64).to(torch.bfloat16)
    x, r = (torch.randn(5, 64, generator=gen).bfloat16() for _ in range(2))
    buf = torch.full((5, 3 * 64), 7.0, dtype=torch.bfloat16)
    view = buf[:, 64:128]
    out, summed = norm(x, r, sum_out=view)
    assert summed.data_ptr() == view.data_ptr() and torch.equal(view, x + r)
    assert torch.equal(out, norm(x + r))
    assert (buf[:, :64] == 7).all() and (buf[:, 128:] == 7).all()


@pytest.mark.parametrize("bad", ["no_residual", "shape", "dtype"])
def test_sum_out_is_refused_where_it_cannot_hold_the_sum(bad):
    norm = RMSNorm(32)
    x = torch.zeros(4, 32)
    out = {"no_residual": torch.zeros(4, 32), "shape": torch.zeros(4, 16),
           "dtype": torch.zeros(4, 32, dtype=torch.float64)}[bad]
    with pytest.raises(ValueError, match="sum_out"):
        norm(x, None if bad == "no_residual" else torch.zeros(4, 32), sum_out=out)


def test_rms_norm_rejects_wrong_width():
    with pytest.raises(ValueError, match="last dim 32"):
        RMSNorm(64)(torch.zeros(2, 32))


@pytest.mark.slow
def test_rms_norm_and_rope_kernels_under_interpreter():
    """The Triton RMSNorm (+ residual) and RoPE kernels, run by Triton's CPU interpreter, equal the
    torch paths (strided inputs, non-power-of-two widths, both rope layouts, 0..16 heads)."""
    run_interpreter_driver(DRIVER, ("rms_norm", "rope"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [512, 1536, 7168])
def test_rms_norm_triton_matches_torch_on_gpu(dtype, hidden):
    from vllm.model_executor.layers.layernorm import rms_norm_triton
    gen = torch.Generator(device="cuda").manual_seed(3)
    w = (torch.rand(hidden, device="cuda", generator=gen) + 0.5).to(dtype)
    for rows in (1, 7, 64):
        base = torch.randn(rows, hidden + 64, device="cuda", generator=gen).to(dtype)
        x = base[:, :hidden]  # strided rows, like kv_c
        r = torch.randn(rows, hidden, device="cuda", generator=gen).to(dtype)
        rms_norm_triton(x, w, 1e-6, r), rms_norm_triton(x, w, 1e-6)  # compile first
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any host sync raises
        try:
            out, summed = rms_norm_triton(x, w, 1e-6, r)
            plain = rms_norm_triton(x, w, 1e-6)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ref_out, ref_sum = rms_norm_torch(x, w, 1e-6, r)
        assert torch.equal(summed, ref_sum)  # the residual stream is exact
        tol = dict(rtol=1.6e-2, atol=1.6e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, ref_out, **tol)
        torch.testing.assert_close(plain, rms_norm_torch(x, w, 1e-6), **tol)


@pytest.mark.gpu
def test_sum_out_on_gpu_is_the_torch_sum_in_a_column_slice():
    from vllm.model_executor.layers.layernorm import rms_norm_triton
    gen = torch.Generator(device="cuda").manual_seed(5)
    for hidden in (256, 7168):
        x, r = (torch.randn(9, hidden, device="cuda", generator=gen).bfloat16() for _ in range(2))
        w = (torch.rand(hidden, device="cuda", generator=gen) + 0.5).bfloat16()
        buf = torch.zeros(9, 3 * hidden, device="cuda", dtype=torch.bfloat16)
        out, summed = rms_norm_triton(x, w, 1e-6, r, sum_out=buf[:, 2 * hidden:])
        assert summed.data_ptr() == buf[:, 2 * hidden:].data_ptr()
        assert torch.equal(buf[:, 2 * hidden:], x + r) and not buf[:, :2 * hidden].any()
        assert torch.equal(out, rms_norm_triton(x, w, 1e-6, r)[0])


@pytest.mark.gpu
def test_rms_norm_module_in_cuda_graph():
    norm = RMSNorm(7168).cuda().to(torch.bfloat16)
    x = torch.randn(8, 7168, device="cuda").bfloat16()
    r = torch.randn(8, 7168, device="cuda").bfloat16()
    norm(x, r)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, summed = norm(x, r)
    x.copy_(torch.randn_like(x))
    r.copy_(torch.randn_like(r))
    graph.replay()
    torch.cuda.synchronize()
    ref_out, ref_sum = rms_norm_torch(x, norm.weight, norm.variance_epsilon, r)
    assert torch.equal(summed, ref_sum)
    torch.testing.assert_close(out, ref_out, rtol=1.6e-2, atol=1.6e-2)
