"""Tuned block-FP8 GEMM config tables (layers/quantization/fp8_gemm_configs.py) and the dispatch
that uses them (fp8_kernels.select_config): upstream file naming, nearest-M lookup, heuristic
fallback, one-line refusals of malformed files. Host-only: no GPU, no triton launch."""
import json

import pytest
import torch

from vllm.model_executor.layers.quantization import fp8_kernels
from vllm.model_executor.layers.quantization.fp8_gemm_configs import (W8A8_TAG, W8A16_TAG, GemmConfig,
                                                                      config_file_name, find_table,
                                                                      load_config_table, nearest_config)

BLOCK = (128, 128)
DEVICE = "NVIDIA H200"


def _entry(bm, bn=64, split=1, kernel=None, **extra):
    e = {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
         "num_warps": 4, "num_stages": 3, "SPLIT_K": split, **extra}
    if kernel is not None:
        e["KERNEL"] = kernel
    return e


def _write(tmp_path, n, k, tag, table):
    path = tmp_path / config_file_name(n, k, "NVIDIA_H200", tag, BLOCK)
    path.write_text(json.dumps({str(m): v for m, v in table.items()}))
    return path


def test_file_name_matches_upstream_pattern():
    assert (config_file_name(576, 7168, "NVIDIA_H200", W8A8_TAG, BLOCK)
            == "N=576,K=7168,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json")


def test_nearest_entry_is_picked_as_upstream_does(tmp_path):
    path = _write(tmp_path, 576, 7168, W8A8_TAG, {1: _entry(16, split=16), 8: _entry(16, split=8),
                                                 32: _entry(32, split=4), 64: _entry(64, split=2)})
    table = load_config_table(str(path), W8A8_TAG, BLOCK)
    # brute force: the key minimising |key - m|, the smaller key on a tie
    for m in range(1, 65):
        best = sorted(table, key=lambda key: (abs(key - m), key))[0]
        assert nearest_config(table, m) == table[best], m
    assert nearest_config(table, 3).split_k == 16 and nearest_config(table, 5).split_k == 8
    assert nearest_config(table, 20).split_k == 8  # |20-8| == |20-32|: the smaller key, as upstream's min()
    assert nearest_config(table, 21).split_k == 4
    assert nearest_config(table, 65) is None  # beyond the tuned range: heuristic


def test_select_config_uses_tables_then_falls_back(tmp_path):
    n, k = 576, 7168
    _write(tmp_path, n, k, W8A16_TAG, {1: _entry(1, 16, split=4, kernel="gemv"),
                                      16: _entry(16, 64, split=2, kernel="dot"),
                                      32: _entry(32, 64, kernel="dot")})
    _write(tmp_path, n, k, W8A8_TAG, {64: _entry(64, 128, split=2)})
    select = lambda m, device=DEVICE, dtype=torch.bfloat16: fp8_kernels.select_config(  # noqa: E731
        m, n, k, BLOCK, device, dtype, 132, str(tmp_path))
    assert select(1) == GemmConfig("w8a16_gemv", 1, 16, 128, 4, 3, 4, 1)
    assert select(12).kernel == "w8a16_dot" and select(12).block_m == 16
    assert select(32).kernel == "w8a16_dot"  # the W8A16 table reaches M = 32
    assert select(33) == GemmConfig("w8a8_dot", 64, 128, 128, 4, 3, 2, 1)
    big = select(4096)  # beyond the W8A8 table: the heuristic, no split for a compute-bound GEMM
    assert big.kernel == "w8a8_dot" and big.split_k == 1
    bm, bn, split = fp8_kernels._plan(4096, n, k, BLOCK, torch.device("cpu"))
    assert (big.block_m, big.block_n, big.split_k) == (bm, bn, split)
    # another device name has no table: M <= SMALL_M_MAX takes the W8A16 heuristic
    assert select(1, device="NVIDIA H100 80GB HBM3") == fp8_kernels._plan_w8a16(1, n, k, BLOCK, 132)
    assert select(fp8_kernels.SMALL_M_MAX + 1, device="other").kernel == "w8a8_dot"
    # an activation dtype the W8A16 kernels do not take goes to W8A8
    assert select(1, dtype=torch.float8_e4m3fn).kernel == "w8a8_dot"
    assert find_table(n, k, DEVICE, W8A8_TAG, BLOCK, str(tmp_path / "none")) is None
    # a tuned shape with only a W8A8 table (W8A8 measured faster at the smallest M): W8A8 at every M
    _write(tmp_path, 1536, k, W8A8_TAG, {1: _entry(16, split=8)})
    only = fp8_kernels.select_config(1, 1536, k, BLOCK, DEVICE, torch.bfloat16, 132, str(tmp_path))
    assert only == GemmConfig("w8a8_dot", 16, 64, 128, 4, 3, 8, 1), only


def test_env_folder_is_searched_before_the_package(tmp_path, monkeypatch):
    _write(tmp_path, 1536, 7168, W8A8_TAG, {1: _entry(16, split=3)})
    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(tmp_path))
    assert find_table(1536, 7168, DEVICE, W8A8_TAG, BLOCK)[1].split_k == 3


@pytest.mark.parametrize("content,needle", [
    ("{not json", "not valid JSON"),
    ("[]", "non-empty JSON object"),
    (json.dumps({"one": _entry(16)}), "key 'one'"),
    (json.dumps({"1": _entry(16, BLOCK_SIZE_Q=2)}), "unknown keys ['BLOCK_SIZE_Q']"),
    (json.dumps({"1": {"BLOCK_SIZE_M": 16}}), "lacks ['BLOCK_SIZE_N'"),
    (json.dumps({"1": _entry(16, bn=48)}), "BLOCK_SIZE_N=48"),
    (json.dumps({"1": {**_entry(16), "BLOCK_SIZE_K": 256}}), "BLOCK_SIZE_K=256 must divide"),
    (json.dumps({"1": {**_entry(16), "num_warps": "4"}}), "num_warps='4' must be an integer"),
    (json.dumps({"1": _entry(16, kernel="gemv")}), "only has the 'dot' kernel"),
])
def test_malformed_w8a8_file_is_refused_in_one_line_naming_it(tmp_path, content, needle):
    path = tmp_path / "N=1,K=2,device_name=X,dtype=fp8_w8a8,block_shape=[128,128].json"
    path.write_text(content)
    with pytest.raises(ValueError) as err:
        load_config_table(str(path), W8A8_TAG, BLOCK)
    msg = str(err.value)
    assert str(path) in msg and needle in msg and "\n" not in msg, msg


def test_w8a16_file_needs_a_kernel_name(tmp_path):
    path = _write(tmp_path, 64, 128, W8A16_TAG, {1: _entry(1, 16)})
    with pytest.raises(ValueError, match=r"KERNEL=None must be 'dot' or 'gemv'") as err:
        load_config_table(str(path), W8A16_TAG, BLOCK)
    assert str(path) in str(err.value)
    path = _write(tmp_path, 64, 256, W8A16_TAG, {1: _entry(8, 16, kernel="dot")})
    with pytest.raises(ValueError, match="BLOCK_SIZE_M=8 must be a power of two >= 16"):
        load_config_table(str(path), W8A16_TAG, BLOCK)  # tl.dot tiles are at least 16 wide


def test_config_round_trips_through_json(tmp_path):
    cfgs = {1: GemmConfig("w8a16_gemv", 2, 32, 64, 8, 2, 4), 16: GemmConfig("w8a16_dot", 16, 128, 128, 4, 5, 1)}
    path = _write(tmp_path, 3072, 1536, W8A16_TAG, {m: c.to_json() for m, c in cfgs.items()})
    assert load_config_table(str(path), W8A16_TAG, BLOCK) == cfgs


def test_kernel_wrappers_refuse_bad_operands_in_one_line():
    """Argument checks run before any launch (CPU tensors, no interpreter needed)."""
    pytest.importorskip("triton")
    from vllm.model_executor.layers.quantization.fp8_utils import block_quantize
    qw, sw = block_quantize(torch.randn(200, 300), BLOCK)
    x = torch.randn(3, 300)
    cases = [
        (lambda: fp8_kernels.w8a16_block_fp8_matmul(x[:, :256], qw, sw, BLOCK), "activation K=256 != weight K=300"),
        (lambda: fp8_kernels.w8a16_block_fp8_matmul(x, qw, sw[:, :2], BLOCK), "weight_scale shape (2, 2)"),
        (lambda: fp8_kernels.w8a16_block_fp8_matmul(x.to(torch.float64), qw, sw, BLOCK), "torch.float64"),
        (lambda: fp8_kernels.w8a16_block_fp8_matmul(x.t().contiguous().t(), qw, sw, BLOCK), "unit column stride"),
        (lambda: fp8_kernels.w8a16_block_fp8_matmul(x, qw, sw, BLOCK, bias=torch.zeros(7)), "bias shape (7,)"),
        (lambda: fp8_kernels.w8a16_block_fp8_matmul(x, qw, sw, BLOCK, config=GemmConfig("w8a8_dot", 16, 64, 128)),
         "not a W8A16 kernel"),
        (lambda: fp8_kernels.w8a16_block_fp8_matmul(x, qw, sw, BLOCK, config=GemmConfig("w8a16_dot", 16, 64, 96)),
         "BLOCK_SIZE_K=96"),
        (lambda: fp8_kernels.w8a8_block_fp8_matmul(x.to(torch.float8_e4m3fn), torch.ones(3, 3), qw, sw, BLOCK,
                                                   torch.float32, config=GemmConfig("w8a16_gemv", 1, 16, 128)),
         "not w8a8_dot"),
        (lambda: fp8_kernels.w8a8_block_fp8_matmul(x.to(torch.float8_e4m3fn), torch.ones(3, 1), qw, sw, BLOCK,
                                                   torch.float32), "a_scale (shape (3, 1))"),
    ]
    for call, needle in cases:
        with pytest.raises(ValueError) as err:
            call()
        assert needle in str(err.value) and "\n" not in str(err.value), (needle, str(err.value))
