"""benchmarks/kernels/tune_fp8_gemm.py without a GPU: its config spaces are valid for the kernels,
the table rule (W8A16 for M <= 16, then while it beats W8A8) and the files it writes load back
through the kernels' table loader with the same configs; the report renders."""
import importlib.util
import sys
from pathlib import Path

import pytest

from vllm.model_executor.layers.quantization import fp8_kernels
from vllm.model_executor.layers.quantization.fp8_gemm_configs import W8A8_TAG, W8A16_TAG, GemmConfig

_KERNELS_DIR = Path(__file__).parents[2] / "benchmarks" / "kernels"


@pytest.fixture(scope="module")
def tuner():
    sys.path.insert(0, str(_KERNELS_DIR))
    try:
        spec = importlib.util.spec_from_file_location("tune_fp8_gemm", _KERNELS_DIR / "tune_fp8_gemm.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["tune_fp8_gemm"] = mod  # its dataclasses look their module up
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("tune_fp8_gemm", None)
        sys.path.remove(str(_KERNELS_DIR))


def test_spaces_are_valid_and_cover_both_kernels(tuner):
    for n, k in tuner.SHAPES.values():
        for m in tuner.DEFAULT_M:
            small, big = tuner.w8a16_space(m, n, k, 132), tuner.w8a8_space(m, n, k, 132)
            assert small and big
            for cfg in small + big:
                cfg.check(tuner.BLOCK)
                assert cfg.block_m >= min(m, 64) or cfg.kernel == "w8a16_gemv" and cfg.block_m >= m
            kinds = {c.kernel for c in small}
            assert kinds == ({"w8a16_dot", "w8a16_gemv"} if m <= 8 else {"w8a16_dot"}), (m, kinds)
            assert {c.kernel for c in big} == {"w8a8_dot"}
    # narrow kv_a_proj at M = 1 is offered deep K splits
    assert max(c.split_k for c in tuner.w8a16_space(1, 576, 7168, 132)) == 16


def _result(tuner, m, w8a16_us, w8a8_us):
    r = tuner.Result("x", 576, 7168, m, bf16_us=10.0, fp8_bytes=576 * 7168)
    r.trials["w8a16"] = [(GemmConfig("w8a16_dot", 16, 64, 128, split_k=m), w8a16_us, 1e-3, ""),
                         (GemmConfig("w8a16_dot", 16, 32, 128), None, 0.5, "WRONG")]
    r.trials["w8a8"] = [(GemmConfig("w8a8_dot", 16, 64, 128, split_k=m), w8a8_us, 0.03, "")]
    return r


def test_table_rule_and_files_round_trip(tuner, tmp_path):
    # W8A8 wins at M = 8: the W8A16 table stops below it (the measured times pick the path, also
    # where W8A16 wins again at 16 and 32); the failed config never wins
    results = [_result(tuner, 1, 3.0, 9.0), _result(tuner, 8, 6.0, 5.0), _result(tuner, 16, 4.0, 8.0),
               _result(tuner, 32, 5.0, 9.0), _result(tuner, 64, 9.0, 7.0)]
    w8a16, w8a8 = tuner.choose_tables(results)
    assert sorted(w8a16) == [1] and sorted(w8a8) == [1, 8, 16, 32, 64]
    # W8A8 faster already at M = 1: no W8A16 table at all
    assert tuner.choose_tables([_result(tuner, 1, 9.0, 3.0), _result(tuner, 8, 4.0, 5.0)])[0] == {}
    results[1] = _result(tuner, 8, 4.0, 5.0)  # W8A16 wins everywhere up to 32 -> the table reaches 32
    w8a16, w8a8 = tuner.choose_tables(results)
    assert sorted(w8a16) == [1, 8, 16, 32] and w8a16[32].split_k == 32
    paths = tuner.write_tables(tmp_path, "NVIDIA H200", 576, 7168, w8a16, w8a8)
    assert [p.name for p in paths] == [
        "N=576,K=7168,device_name=NVIDIA_H200,dtype=fp8_w8a16,block_shape=[128,128].json",
        "N=576,K=7168,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json"]
    select = lambda m: fp8_kernels.select_config(m, 576, 7168, (128, 128), "NVIDIA H200",  # noqa: E731
                                                 fp8_kernels.torch.bfloat16, 132, str(tmp_path))
    assert select(32) == w8a16[32] and select(33) == w8a8[32] and select(64) == w8a8[64]
    report = tuner.render_report(results, "NVIDIA H200", 4000.0, 1.0, "")
    assert "| x | 576 | 7168 | 1 | 10.0 | 3.0 |" in report and "WRONG" in report
    assert W8A8_TAG != W8A16_TAG
