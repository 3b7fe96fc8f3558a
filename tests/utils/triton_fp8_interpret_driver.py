"""Runs the block-FP8 Triton kernels (layers/quantization/fp8_kernels.py) on CPU tensors under
TRITON_INTERPRET=1 and compares them with float64 / torch references. Launched in a subprocess by
tests/model_executor/test_fp8_triton_interpreter.py."""
import os

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

try:
    import triton  # noqa: F401
except ImportError:
    print("NO_TRITON")
    raise SystemExit(0)

from vllm.model_executor.layers.quantization import fp8_kernels  # noqa: E402
from vllm.model_executor.layers.quantization.fp8_utils import (block_quantize,  # noqa: E402
                                                               per_token_group_quant_reference)


def gemm_oracle(qa, sa, qw, sw, block):
    """float64 sum over K blocks of (A_blk W_blk^T) * a_scale * w_scale."""
    bn, bk = block
    m, k = qa.shape
    n = qw.shape[0]
    out = torch.zeros(m, n, dtype=torch.float64)
    for kb in range(-(-k // bk)):
        a = qa[:, kb * bk:(kb + 1) * bk].double()
        w = qw[:, kb * bk:(kb + 1) * bk].double()
        w_scale = sw[:, kb].double().repeat_interleave(bn)[:n]
        out += (a @ w.T) * sa[:, kb].double()[:, None] * w_scale[None, :]
    return out


def check_gemm(gen):
    for m, n, k, block in [(1, 96, 256, (128, 128)), (5, 200, 300, (128, 128)), (33, 256, 384, (128, 128)),
                           (17, 160, 300, (64, 64)), (70, 130, 128, (128, 128)), (1, 64, 1024, (128, 128))]:
        x = torch.randn(m, k, generator=gen)
        w = torch.randn(n, k, generator=gen) / k ** 0.5
        qa, sa = per_token_group_quant_reference(x, block[1])
        qw, sw = block_quantize(w, block)
        ref = gemm_oracle(qa, sa, qw, sw, block)
        # split_k None = the shape heuristic; 1 = no split; 3 = uneven K ranges (5 K blocks of 64
        # -> 2 + 2 + 1); a split larger than the K blocks is clamped
        for split in (None, 1, 3, 64):
            got = fp8_kernels.w8a8_block_fp8_matmul(qa, sa, qw, sw, block, torch.float32, split_k=split)
            assert got.shape == (m, n)
            err = (got.double() - ref).abs().max().item() / ref.abs().max().item()
            assert err < 1e-5, (m, n, k, block, split, err)


def check_split_plan():
    # decode shapes of a V3 TP8 rank on 132 SMs: narrow kv_a (9 column tiles) is split over K
    cpu = torch.device("cpu")
    assert fp8_kernels._plan(1, 576, 7168, (128, 128), cpu) == (16, 64, 16)
    assert fp8_kernels._plan(1, 7168, 2048, (128, 128), cpu)[2] == 3
    assert fp8_kernels._plan(256, 7168, 7168, (128, 128), cpu)[2] == 1  # prefill: enough tiles


def check_group_quant(gen):
    for m, k in [(1, 128), (7, 300), (16, 512)]:
        x = torch.randn(m, k, generator=gen) * torch.linspace(0.1, 4.0, k)
        q, s = fp8_kernels.per_token_group_quant_fp8(x, 128)
        q_ref, s_ref = per_token_group_quant_reference(x, 128)
        assert torch.equal(s, s_ref), (m, k)
        got, want = q.float(), q_ref.float()
        # The interpreter emulates the float32 -> e4m3 cast in numpy without exact round-to-nearest:
        # a value that rounds up to a power of two can land in the binade below, and subnormals
        # can be truncated by one step. GPU casts are compared exactly by the gpu test; here each
        # value must be the reference or one of those two neighbours, and most must be identical.
        mag = want.abs().clamp(min=2.0 ** -9)
        step = torch.maximum(2.0 ** (torch.floor(torch.log2(mag)) - 3), torch.tensor(2.0 ** -9))
        pow2 = (want != 0) & (torch.log2(want.abs()) == torch.log2(want.abs()).round())
        ok = (got == want) | (pow2 & (got == want / 2)) | ((got - want).abs() <= step)
        assert ok.all(), (m, k, got[~ok].tolist()[:5], want[~ok].tolist()[:5])
        assert (got == want).float().mean() > 0.9, (m, k)


def check_linear(gen):
    x = torch.randn(2, 3, 256, generator=gen)
    w = torch.randn(192, 256, generator=gen) / 16
    bias = torch.randn(192, generator=gen)
    qw, sw = block_quantize(w, (128, 128))
    got = fp8_kernels.apply_w8a8_block_fp8_linear(x, qw, sw, (128, 128), bias)
    assert got.shape == (2, 3, 192)
    qa, sa = fp8_kernels.per_token_group_quant_fp8(x.reshape(6, 256), 128)
    ref = gemm_oracle(qa, sa, qw, sw, (128, 128)).float().view(2, 3, 192) + bias
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    check_gemm(g)
    check_split_plan()
    check_group_quant(g)
    check_linear(g)
    print("TRITON_INTERPRET_OK")
