"""The block-FP8 Triton kernels compile for Hopper (sm_90) on a CPU-only machine: Triton's frontend,
its GPU passes and the bundled ptxas run without a GPU. Catches lowering errors (layouts, dtype
casts, pipelining) of every kernel variant the heuristics launch before any GPU time is spent;
the numerics are checked by the interpreter and GPU tests."""
import inspect

import pytest

triton = pytest.importorskip("triton")

from vllm.model_executor.layers.quantization import fp8_kernels as fk  # noqa: E402

_PTRS = {"x_ptr": "*bf16", "a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32",
         "bias_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32", "lock_ptr": "*i32", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32",
         "fp8_max": "fp32", "min_scale": "fp32"}
# what the launcher specialises at V3 shapes: 16-byte aligned pointers, N/K/strides % 16 == 0
_DIV16 = ({a for a, t in _PTRS.items() if t.startswith("*")}
          | {"N", "K", "stride_xm", "stride_am", "stride_wn", "stride_om"})


def _compile(kernel, constexprs, num_warps, num_stages):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    if "attrs" not in inspect.signature(ASTSource.__init__).parameters:
        pytest.skip("this triton's ASTSource takes no attrs (needs triton >= 3.3)")
    sig = {a: _PTRS.get(a, "i32") for a in kernel.arg_names}
    sig.update({c: "constexpr" for c in constexprs})
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(kernel.arg_names) if a in _DIV16}
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def _gemm_constexprs(cfg, split, serial):
    c = dict(GROUP_N=128, GROUP_K=128, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
             IS_SPLIT=split, HAS_BIAS=not split or serial, SERIAL=serial)
    if cfg.kernel == "w8a16_dot":
        c["FP32_IEEE"] = False
    elif cfg.kernel == "w8a16_gemv":
        c["NUM_STAGES"] = cfg.num_stages
    else:
        c["GROUP_M"] = cfg.group_m
    return c


@pytest.mark.slow
def test_fp8_kernels_compile_for_sm90_without_a_gpu():
    from vllm.model_executor.layers.quantization.fp8_gemm_configs import GemmConfig
    kernels = {"w8a16_dot": fk._w8a16_dot_kernel, "w8a16_gemv": fk._w8a16_gemv_kernel,
               "w8a8_dot": fk._w8a8_dot_kernel}
    # the decode and prefill heuristics at the V3-rank shapes, and one CUDA-core config per M tile
    configs = {fk._plan_w8a16(m, n, k, (128, 128), 132) for m in (1, 32) for n, k in [(576, 7168), (7168, 2048)]}
    configs |= {fk.w8a8_config(m, 7168, 2048, (128, 128), None, 132) for m in (32, 4096)}
    configs |= {GemmConfig("w8a16_gemv", 1, 16, 128, 4, 3), GemmConfig("w8a16_gemv", 4, 16, 128, 4, 1)}
    for cfg in sorted(configs, key=repr):
        # no split; split with the reduce kernel; split reduced by the last split (tickets)
        for split, serial in ((False, False), (True, False), (True, True)):
            compiled = _compile(kernels[cfg.kernel], _gemm_constexprs(cfg, split, serial), cfg.num_warps,
                                cfg.num_stages)
            assert compiled.asm["cubin"], cfg
    _compile(fk._splitk_reduce_kernel, dict(BLOCK=1024, HAS_BIAS=True), 4, 1)
    _compile(fk._per_token_group_quant_kernel, dict(GROUP=128), 4, 1)
