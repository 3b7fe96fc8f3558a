"""Runs the block-FP8 Triton kernels (layers/quantization/fp8_kernels.py) on CPU tensors under
TRITON_INTERPRET=1 and compares them with float64 / torch references. Launched in a subprocess by
tests/model_executor/test_fp8_triton_interpreter.py; the arguments name the checks to run
(w8a8, w8a16, linear; none = all).

Triton 3.8's interpreter computes tl.dot on bfloat16 operands wrongly (it multiplies the raw bit
patterns), so the tensor-core W8A16 kernel is checked here with float16 and float32 activations;
bfloat16 runs in the GPU test (tests/model_executor/test_fp8_gpu.py)."""
import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

try:
    import triton  # noqa: F401
except ImportError:
    print("NO_TRITON")
    raise SystemExit(0)

from vllm.model_executor.layers.quantization import fp8_kernels  # noqa: E402
from vllm.model_executor.layers.quantization.fp8_gemm_configs import GemmConfig  # noqa: E402
from vllm.model_executor.layers.quantization.fp8_utils import (block_dequantize,  # noqa: E402
                                                               block_quantize,
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
        # explicit configs: grouped tile order (GROUP_SIZE_M 2), K chunks smaller than the scale
        # block, a bias added in the GEMM epilogue (no split) and in the reduce kernel (split 2)
        bias = torch.randn(n, generator=gen)
        for cfg in (GemmConfig("w8a8_dot", 16, 32, block[1] // 2, group_m=2),
                    GemmConfig("w8a8_dot", 32, 64, block[1], split_k=2)):
            got = fp8_kernels.w8a8_block_fp8_matmul(qa, sa, qw, sw, block, torch.float32, bias=bias,
                                                    config=cfg)
            err = (got.double() - ref - bias.double()).abs().max().item() / ref.abs().max().item()
            assert err < 1e-5, (m, n, k, block, cfg, err)


def w8a16_oracle(x, qw, sw, block, bias=None):
    """float64 x . dequant(W)^T (+ bias): the W8A16 numerics (activation not quantised)."""
    out = x.double() @ block_dequantize(qw, sw, block, torch.float64).T
    return out if bias is None else out + bias.double()


def check_w8a16(gen):
    # K = 300: a partial last scale block; N = 200: a partial last tile for every BLOCK_N; M 17: one
    # row past a 16-row tile
    n, k, block = 200, 300, (128, 128)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    qw, sw = block_quantize(w, block)
    bias = torch.randn(n, generator=gen)
    # output rounding of the activation dtype (relative to the largest output)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
    configs = [GemmConfig("w8a16_dot", 16, 64, 128), GemmConfig("w8a16_dot", 32, 32, 64, split_k=3),
               GemmConfig("w8a16_gemv", 1, 16, 128, split_k=2), GemmConfig("w8a16_gemv", 4, 32, 64)]
    for m in (1, 3, 16, 17):
        x32 = torch.randn(m, k, generator=gen)
        for cfg in configs:
            dtypes = (torch.float32, torch.float16) if cfg.kernel == "w8a16_dot" else (torch.float32,
                                                                                         torch.bfloat16)
            for dtype in dtypes:
                x = x32.to(dtype)
                b = bias.to(dtype) if cfg.split_k > 1 or m == 3 else None
                ref = w8a16_oracle(x, qw, sw, block, b)
                got = fp8_kernels.w8a16_block_fp8_matmul(x, qw, sw, block, bias=b, config=cfg)
                assert got.shape == (m, n) and got.dtype == dtype, (got.shape, got.dtype)
                err = (got.double() - ref).abs().max().item() / ref.abs().max().item()
                assert err < tol[dtype], (m, cfg, dtype, err)
    # BLOCK_N wider than the 64-row scale block: each row of a tile reads its own scale
    block = (64, 64)
    qw, sw = block_quantize(w, block)
    x = torch.randn(5, k, generator=gen)
    for cfg in (GemmConfig("w8a16_dot", 16, 128, 64), GemmConfig("w8a16_gemv", 8, 128, 32, split_k=4)):
        got = fp8_kernels.w8a16_block_fp8_matmul(x, qw, sw, block, config=cfg)
        ref = w8a16_oracle(x, qw, sw, block)
        err = (got.double() - ref).abs().max().item() / ref.abs().max().item()
        assert err < 1e-5, (cfg, err)
    # a row stride larger than K (a view into a wider buffer) is read in place
    wide = torch.randn(3, k + 20, generator=gen)
    x = wide[:, :k]
    got = fp8_kernels.w8a16_block_fp8_matmul(x, qw, sw, block)
    err = (got.double() - w8a16_oracle(x, qw, sw, block)).abs().max().item()
    assert err < 1e-4, err
    # the heuristic plan (no table on CPU) splits kv_a_proj-like narrow weights over K
    cfg = fp8_kernels.w8a16_config(1, 576, 7168, (128, 128), None, 132)
    assert cfg.kernel == "w8a16_dot" and cfg.split_k > 1, cfg


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
    """The entry point: decode-sized batches (M <= SMALL_M_MAX) take the W8A16 kernel (activation
    kept in float32 here), larger ones quantise the activation and take the W8A8 kernel."""
    w = torch.randn(192, 256, generator=gen) / 16
    bias = torch.randn(192, generator=gen)
    qw, sw = block_quantize(w, (128, 128))
    x = torch.randn(2, 3, 256, generator=gen)  # M = 6
    got = fp8_kernels.apply_w8a8_block_fp8_linear(x, qw, sw, (128, 128), bias)
    assert got.shape == (2, 3, 192)
    ref = w8a16_oracle(x.reshape(6, 256), qw, sw, (128, 128), bias).float().view(2, 3, 192)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    m = fp8_kernels.SMALL_M_MAX + 1
    x = torch.randn(m, 256, generator=gen)
    got = fp8_kernels.apply_w8a8_block_fp8_linear(x, qw, sw, (128, 128), bias)
    qa, sa = fp8_kernels.per_token_group_quant_fp8(x, 128)
    ref = gemm_oracle(qa, sa, qw, sw, (128, 128)).float() + bias
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def check_split_reduce(gen):
    """Split-K reduced inside the GEMM by each tile's last split (tickets) gives the same bits as
    the separate reduce kernel (both add the splits in order 0..split-1, then the bias), for all
    three kernels; the tickets are back at zero after every launch; a grid with more tiles than
    tickets takes the reduce kernel."""
    m, n, k, block = 5, 200, 640, (128, 128)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    bias = torch.randn(n, generator=gen)
    qw, sw = block_quantize(w, block)
    qa, sa = per_token_group_quant_reference(x, block[1])
    tickets = fp8_kernels._split_tickets(torch.device("cpu"))
    launches = [
        lambda cfg, serial: fp8_kernels.w8a8_block_fp8_matmul(qa, sa, qw, sw, block, torch.float32,
                                                              bias=bias, config=cfg, serial_reduce=serial),
        lambda cfg, serial: fp8_kernels.w8a16_block_fp8_matmul(x, qw, sw, block, bias=bias, config=cfg,
                                                               serial_reduce=serial),
        lambda cfg, serial: fp8_kernels.w8a16_block_fp8_matmul(x, qw, sw, block, bias=bias, config=cfg,
                                                               serial_reduce=serial)]
    configs = [GemmConfig("w8a8_dot", 16, 64, 128, split_k=3), GemmConfig("w8a16_dot", 16, 64, 128, split_k=5),
               GemmConfig("w8a16_gemv", 2, 32, 128, split_k=4)]
    refs = [gemm_oracle(qa, sa, qw, sw, block) + bias.double(), w8a16_oracle(x, qw, sw, block, bias),
            w8a16_oracle(x, qw, sw, block, bias)]
    for launch, cfg, ref in zip(launches, configs, refs):
        in_kernel = launch(cfg, None)
        assert int(tickets.abs().sum()) == 0, (cfg, "tickets not reset")
        separate = launch(cfg, False)
        assert torch.equal(in_kernel, separate), (cfg, (in_kernel - separate).abs().max())
        err = (in_kernel.double() - ref).abs().max().item() / ref.abs().max().item()
        assert err < 1e-5, (cfg, err)
    # more tiles than tickets: the reduce kernel runs (same bits), tickets untouched
    saved = fp8_kernels.SPLIT_TICKETS
    fp8_kernels.SPLIT_TICKETS = 2
    try:
        assert not fp8_kernels._serial_reduce(4, 3, None) and fp8_kernels._serial_reduce(2, 3, None)
        got = launches[1](configs[1], None)
        assert torch.equal(got, launches[1](configs[1], False))
    finally:
        fp8_kernels.SPLIT_TICKETS = saved
    assert int(tickets.abs().sum()) == 0


CHECKS = {"w8a8": lambda g: (check_gemm(g), check_split_plan(), check_group_quant(g)),
          "w8a16": check_w8a16, "linear": check_linear, "split": check_split_reduce}


if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    for name in sys.argv[1:] or list(CHECKS):
        CHECKS[name](g)
    print("TRITON_INTERPRET_OK")
