"""Tuned launch configurations of the block-FP8 GEMMs (fp8_kernels.py), one JSON file per weight
shape, named as upstream vLLM names its w8a8 block-FP8 tables:

    N={N},K={K},device_name={DEVICE},dtype={TAG},block_shape=[{bn},{bk}].json

DEVICE is torch.cuda.get_device_name() with spaces replaced by underscores (e.g. NVIDIA_H200).
TAG is `fp8_w8a8` for the tensor-core W8A8 kernel (upstream's keys) and `fp8_w8a16` for the
small-M weight-streaming kernel. The file maps M (a JSON string key) to a config:

    {"1": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
           "num_warps": 4, "num_stages": 4, "SPLIT_K": 4, "KERNEL": "dot"}, ...}

SPLIT_K (default 1) and KERNEL (`fp8_w8a16` files only: "dot" or "gemv") are our additions to
upstream's six keys. A call with M tokens uses the entry whose key is nearest to M (as upstream
does) when M is at most the largest key; larger M (prefill, beyond what the table was tuned for)
falls back to the shape heuristic. Files are searched in $VLLM_TUNED_CONFIG_FOLDER (when set)
before this package's `configs/` directory; benchmarks/kernels/tune_fp8_gemm.py writes them.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

PACKAGE_CONFIG_DIR = Path(__file__).parent / "configs"
W8A8_TAG = "fp8_w8a8"
W8A16_TAG = "fp8_w8a16"
KERNELS = ("w8a8_dot", "w8a16_dot", "w8a16_gemv")
_REQUIRED = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "num_warps", "num_stages")
_OPTIONAL = ("GROUP_SIZE_M", "SPLIT_K", "KERNEL")


@dataclass(frozen=True)
class GemmConfig:
    """One launch of a block-FP8 GEMM. kernel: w8a8_dot (quantised activation, fp8 tl.dot),
    w8a16_dot (bf16 tl.dot on W^T tiles, weight cast in registers) or w8a16_gemv (CUDA-core
    multiply-add with one reduction at the end)."""
    kernel: str
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    group_m: int = 1

    def to_json(self) -> dict:
        out = {"BLOCK_SIZE_M": self.block_m, "BLOCK_SIZE_N": self.block_n, "BLOCK_SIZE_K": self.block_k,
               "GROUP_SIZE_M": self.group_m, "num_warps": self.num_warps, "num_stages": self.num_stages,
               "SPLIT_K": self.split_k}
        if self.kernel != "w8a8_dot":
            out["KERNEL"] = self.kernel.removeprefix("w8a16_")
        return out

    def check(self, block: tuple[int, int]) -> None:
        """Raises ValueError (one line) when the kernels cannot run this config with `block`."""
        bk = block[1]
        pow2 = lambda v: v >= 1 and v & (v - 1) == 0  # noqa: E731
        min_mn = 16 if self.kernel.endswith("dot") else 1
        for name, v, low in (("BLOCK_SIZE_M", self.block_m, 16 if self.kernel == "w8a8_dot" else min_mn),
                             ("BLOCK_SIZE_N", self.block_n, 16 if self.kernel.endswith("dot") else 1),
                             ("BLOCK_SIZE_K", self.block_k, 16)):
            if not pow2(v) or v < low:
                raise ValueError(f"{self.kernel}: {name}={v} must be a power of two >= {low}")
        if self.block_k > bk or bk % self.block_k:
            raise ValueError(f"{self.kernel}: BLOCK_SIZE_K={self.block_k} must divide the weight block "
                             f"K={bk} (one scale per K chunk)")
        if self.split_k < 1 or self.group_m < 1 or self.num_stages < 1 or not pow2(self.num_warps):
            raise ValueError(f"{self.kernel}: SPLIT_K={self.split_k}, GROUP_SIZE_M={self.group_m}, "
                             f"num_stages={self.num_stages} must be >= 1 and num_warps={self.num_warps} "
                             "a power of two")


def config_file_name(n: int, k: int, device_name: str, tag: str, block: tuple[int, int]) -> str:
    return f"N={n},K={k},device_name={device_name},dtype={tag},block_shape=[{block[0]},{block[1]}].json"


def device_name_for_table(name: str) -> str:
    return name.replace(" ", "_")


def _parse_entry(path: Path, key: str, raw, tag: str) -> GemmConfig:
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: entry {key!r} must be a JSON object of launch parameters, got "
                         f"{type(raw).__name__}")
    unknown = sorted(set(raw) - set(_REQUIRED) - set(_OPTIONAL))
    missing = [r for r in _REQUIRED if r not in raw]
    if unknown or missing:
        raise ValueError(f"{path}: entry {key!r} has unknown keys {unknown} / lacks {missing}; "
                         f"expected {list(_REQUIRED)} (+ optional {list(_OPTIONAL)})")
    ints = {}
    for name in _REQUIRED + ("GROUP_SIZE_M", "SPLIT_K"):
        v = raw.get(name, 1)
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"{path}: entry {key!r} {name}={v!r} must be an integer")
        ints[name] = v
    if tag == W8A16_TAG:
        kind = raw.get("KERNEL")
        if kind not in ("dot", "gemv"):
            raise ValueError(f"{path}: entry {key!r} KERNEL={kind!r} must be 'dot' or 'gemv' in a "
                             f"{W8A16_TAG} table")
        kernel = f"w8a16_{kind}"
    else:
        if raw.get("KERNEL", "dot") != "dot":
            raise ValueError(f"{path}: entry {key!r} KERNEL={raw['KERNEL']!r}: a {W8A8_TAG} table only "
                             "has the 'dot' kernel")
        kernel = "w8a8_dot"
    return GemmConfig(kernel=kernel, block_m=ints["BLOCK_SIZE_M"], block_n=ints["BLOCK_SIZE_N"],
                      block_k=ints["BLOCK_SIZE_K"], num_warps=ints["num_warps"],
                      num_stages=ints["num_stages"], split_k=ints["SPLIT_K"], group_m=ints["GROUP_SIZE_M"])


@functools.lru_cache(maxsize=None)
def load_config_table(path: str, tag: str, block: tuple[int, int]) -> dict[int, GemmConfig]:
    """{M: GemmConfig} of one table file; ValueError naming the file when it is malformed."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e.msg} at line {e.lineno}); re-run "
                         "benchmarks/kernels/tune_fp8_gemm.py or delete the file") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{p}: expected a non-empty JSON object mapping M to a launch config")
    table = {}
    for key, raw in data.items():
        try:
            m = int(key)
        except ValueError:
            m = 0
        if m < 1:
            raise ValueError(f"{p}: key {key!r} must be a positive token count M")
        cfg = _parse_entry(p, key, raw, tag)
        try:
            cfg.check(block)
        except ValueError as e:
            raise ValueError(f"{p}: entry {key!r}: {e}") from None
        table[m] = cfg
    return table


def nearest_config(table: dict[int, GemmConfig], m: int) -> GemmConfig | None:
    """The entry whose M is nearest to m (ties: the smaller M), None when m exceeds every key."""
    if m > max(table):
        return None
    return table[min(table, key=lambda key: (abs(key - m), key))]


def find_table(n: int, k: int, device_name: str, tag: str, block: tuple[int, int],
               config_dir: str | os.PathLike | None = None) -> dict[int, GemmConfig] | None:
    """The table for this shape and device, or None. `config_dir` None = the override folder
    ($VLLM_TUNED_CONFIG_FOLDER) then the package's configs/."""
    name = config_file_name(n, k, device_name_for_table(device_name), tag, tuple(block))
    if config_dir is not None:
        dirs = [Path(config_dir)]
    else:
        dirs = [Path(d) for d in [os.environ.get("VLLM_TUNED_CONFIG_FOLDER")] if d] + [PACKAGE_CONFIG_DIR]
    for d in dirs:
        path = d / name
        if path.is_file():
            return load_config_table(str(path), tag, tuple(block))
    return None
