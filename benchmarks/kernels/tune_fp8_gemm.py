"""Tune the block-FP8 GEMM launch configs (layers/quantization/fp8_kernels.py) on this GPU and write
the tables the kernels load (fp8_gemm_configs.py; upstream vLLM's file naming):

    {config-dir}/N={N},K={K},device_name={GPU},dtype=fp8_w8a8,block_shape=[128,128].json
    {config-dir}/N={N},K={K},device_name={GPU},dtype=fp8_w8a16,block_shape=[128,128].json

For every DeepSeek-V3 TP8-rank (N, K) (benchmark_fp8_gemm.SHAPES) and M in --m it sweeps a small
config space of BOTH paths: W8A16 (tensor-core `dot` and CUDA-core `gemv` kernels, split-K) and
W8A8 (activation quantisation + fp8 tl.dot, timed together as a layer runs them). Every config is
first checked against the dequantised bf16 GEMM (F.linear on block_dequantize(W), the same values)
and dropped when it fails to compile/launch or misses the tolerance; then timed in a CUDA graph over
rotating weight copies (2x L2 in total, so each call streams its weight from HBM as in a model),
median of graph replays. cuBLAS bf16 is timed the same way in the same run.

Tables: fp8_w8a8 = the fastest W8A8 config per M. fp8_w8a16 = the fastest W8A16 config for the
smallest tuned Ms, as long as W8A16 is at least as fast as W8A8 (quantisation included) for that M
and every smaller one: the entry point runs W8A16 up to the table's largest M and W8A8 above it,
so the measured times of this run decide the path. A shape where W8A8 already wins at the smallest
M gets no fp8_w8a16 file (the entry point then runs W8A8 for every M of that tuned shape). Each shape's files are written as soon as the
shape is done, so a run cut short keeps the finished shapes. The markdown report has the best per
(shape, M) vs bf16, the achieved weight bandwidth vs a device copy measured in the run, and the time
of every config.

Usage (one H200, about 3-4 minutes, mostly Triton compiles; a second run hits Triton's cache):
    python benchmarks/kernels/tune_fp8_gemm.py [--m 1,2,4,8,16,32,64] [--layers q_a_proj,o_proj]
        [--config-dir DIR (default: the package's configs/)] [--report fp8_gemm_tuning.md]
        [--json all_results.json] [--calls 32] [--repeats 5] [--max-seconds 480]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from benchmark_fp8_gemm import BLOCK, SHAPES, describe  # noqa: E402

from vllm.model_executor.layers.quantization.fp8_gemm_configs import (  # noqa: E402
    PACKAGE_CONFIG_DIR, W8A8_TAG, W8A16_TAG, GemmConfig, config_file_name, device_name_for_table)

DEFAULT_M = (1, 2, 4, 8, 16, 32, 64)
# relative Frobenius error vs the dequantised bf16 GEMM: W8A16 differs only by accumulation order
# and bf16 output rounding; W8A8 also rounds the activation to e4m3 (RMS ~3.6 % per element)
TOLERANCE = {"w8a16": 2e-2, "w8a8": 0.08}


def _pow2_at_least(v: int) -> int:
    return 1 << max(0, v - 1).bit_length()


def split_candidates(tiles: int, k_chunks: int, num_sms: int) -> list[int]:
    """1, and the splits that keep >= 2 K chunks per split without exceeding 8 programs per SM."""
    out = [1]
    for s in (2, 4, 8, 16):
        if s <= k_chunks // 2 and tiles * s <= 8 * num_sms and tiles < 4 * num_sms:
            out.append(s)
    return out


def w8a16_space(m: int, n: int, k: int, num_sms: int) -> list[GemmConfig]:
    bk = BLOCK[1]
    chunks = -(-k // bk)
    space = []
    bm = min(64, max(16, _pow2_at_least(m)))  # tl.dot tiles are >= 16 wide
    for bn in (32, 64, 128):
        # 8 warps for the big tiles: with 4, 64 x 128 spills registers (ptxas for sm_90)
        warps = 8 if bm * bn >= 4096 else 4
        for stages in (3, 5):
            for split in split_candidates(-(-m // bm) * -(-n // bn), chunks, num_sms):
                space.append(GemmConfig("w8a16_dot", bm, bn, bk, warps, stages, split))
    if m <= 8:  # the CUDA-core kernel's accumulator holds BLOCK_M * BLOCK_N * BLOCK_K floats
        bm = _pow2_at_least(m)
        for bn in (4, 8, 16, 32, 64):
            if 2048 <= bm * bn * bk <= 8192:
                for stages in (1, 3):  # register loads / cp.async pipeline (see the kernel)
                    for split in split_candidates(-(-m // bm) * -(-n // bn), chunks, num_sms):
                        space.append(GemmConfig("w8a16_gemv", bm, bn, bk, 4, stages, split))
    return space


def w8a8_space(m: int, n: int, k: int, num_sms: int) -> list[GemmConfig]:
    bk = BLOCK[1]
    bm = 16 if m <= 16 else min(64, _pow2_at_least(m))
    space = []
    for bn in (64, 128):
        for stages in (3, 4):
            for split in split_candidates(-(-m // bm) * -(-n // bn), -(-k // bk), num_sms):
                space.append(GemmConfig("w8a8_dot", bm, bn, bk, 4, stages, split))
    return space


@dataclass
class Result:
    layer: str
    n: int
    k: int
    m: int
    bf16_us: float
    fp8_bytes: int
    # per path: [(config, us or None, rel error or None, error text)]
    trials: dict = field(default_factory=lambda: {"w8a16": [], "w8a8": []})
    heuristic_us: dict = field(default_factory=dict)

    def best(self, path: str):
        ok = [(us, cfg) for cfg, us, _, _ in self.trials[path] if us is not None]
        return min(ok, key=lambda t: t[0]) if ok else None


def choose_tables(results: list[Result]) -> tuple[dict[int, GemmConfig], dict[int, GemmConfig]]:
    """({M: W8A16 config}, {M: W8A8 config}) of one shape; see the module docstring for the rule."""
    w8a8 = {r.m: r.best("w8a8")[1] for r in results if r.best("w8a8")}
    w8a16 = {}
    for r in sorted(results, key=lambda r: r.m):
        small, big = r.best("w8a16"), r.best("w8a8")
        if small is None or (big is not None and big[0] < small[0]):
            break
        w8a16[r.m] = small[1]
    return w8a16, w8a8


def write_tables(config_dir: Path, device: str, n: int, k: int, w8a16: dict, w8a8: dict) -> list[Path]:
    config_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for tag, table in ((W8A16_TAG, w8a16), (W8A8_TAG, w8a8)):
        if not table:
            continue
        path = config_dir / config_file_name(n, k, device_name_for_table(device), tag, BLOCK)
        path.write_text(json.dumps({str(m): table[m].to_json() for m in sorted(table)}, indent=4) + "\n",
                        encoding="utf-8")
        written.append(path)
    return written


def render_report(results: list[Result], device: str, copy_gbps: float, elapsed_s: float, note: str) -> str:
    lines = [f"# Block-FP8 GEMM tuning on {device}", "",
             f"torch {torch.__version__}, triton {_triton_version()}; device copy bandwidth "
             f"{copy_gbps:.0f} GB/s (read + write); {elapsed_s:.0f} s. Times: median us per call in a "
             "CUDA graph over rotating weight copies (HBM-streamed). fp8 GB/s = fp8 weight + scale bytes "
             "per second of the chosen path.", ""]
    if note:
        lines += [f"**{note}**", ""]
    lines += ["## Best per shape", "",
              "| layer | N | K | M | bf16 us | W8A16 best us | W8A16 config | W8A8 best us | W8A8 config "
              "| heuristic us (W8A16 / W8A8) | entry point | speed-up vs bf16 | fp8 GB/s | % of copy BW |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    by_shape: dict[tuple, list[Result]] = {}
    for r in results:
        by_shape.setdefault((r.layer, r.n, r.k), []).append(r)
    for (layer, n, k), rs in by_shape.items():
        w8a16_table, _ = choose_tables(rs)
        limit = max(w8a16_table) if w8a16_table else 0  # no W8A16 table: W8A8 for every M
        for r in rs:
            s, b = r.best("w8a16"), r.best("w8a8")
            path = "w8a16" if r.m <= limit and s else "w8a8"
            chosen = s if path == "w8a16" else b
            fmt = lambda t: f"{t[0]:.1f}" if t else "-"  # noqa: E731
            cfg = lambda t: describe(t[1]) if t else "all failed"  # noqa: E731
            heur = " / ".join(f"{r.heuristic_us[p]:.1f}" if r.heuristic_us.get(p) else "-" for p in ("w8a16", "w8a8"))
            if chosen:
                gbps = r.fp8_bytes / chosen[0] / 1e3
                tail = f"{r.bf16_us / chosen[0]:.2f}x | {gbps:.0f} | {100 * gbps / copy_gbps:.0f} %"
            else:
                tail = "- | - | -"
            lines.append(f"| {layer} | {n} | {k} | {r.m} | {r.bf16_us:.1f} | {fmt(s)} | {cfg(s)} | {fmt(b)} | "
                         f"{cfg(b)} | {heur} | {path} | {tail} |")
    lines += ["", "## Every config", "", "| layer | M | config | us | rel. error vs bf16 | note |",
              "|---|---|---|---|---|---|"]
    for r in results:
        for p in ("w8a16", "w8a8"):
            for cfg, us, err, why in r.trials[p]:
                lines.append(f"| {r.layer} | {r.m} | {describe(cfg)} | {'-' if us is None else f'{us:.2f}'} | "
                             f"{'-' if err is None else f'{err:.2e}'} | {why} |")
    return "\n".join(lines) + "\n"


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:80]}"


def _triton_version() -> str:
    try:
        import triton
        return triton.__version__
    except ImportError:
        return "none"


def tune_shape(layer: str, n: int, k: int, ms: list[int], args, num_sms: int) -> list[Result]:
    import torch.nn.functional as F

    from benchmark_fp8_gemm import make_weights, time_graph_us
    from vllm.model_executor.layers.quantization import fp8_kernels as fk

    qws, sws, wbf = make_weights(n, k)
    fp8_bytes = qws[0].numel() + sws[0].numel() * 4
    results = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, wbf[0]).float()
        timed = lambda fn, nv: time_graph_us(fn, nv, calls=args.calls, repeats=args.repeats)  # noqa: E731
        res = Result(layer, n, k, m, timed(lambda i: F.linear(x, wbf[i]), len(wbf)), fp8_bytes)

        def runner(cfg):
            if cfg.kernel == "w8a8_dot":
                return lambda i: fk.w8a8_block_fp8_matmul(*fk.per_token_group_quant_fp8(x, BLOCK[1]), qws[i],
                                                          sws[i], BLOCK, torch.bfloat16, config=cfg)
            return lambda i: fk.w8a16_block_fp8_matmul(x, qws[i], sws[i], BLOCK, config=cfg)

        spaces = {"w8a16": w8a16_space(m, n, k, num_sms), "w8a8": w8a8_space(m, n, k, num_sms)}
        heuristics = {"w8a16": fk._plan_w8a16(m, n, k, BLOCK, num_sms),
                      "w8a8": fk.w8a8_config(m, n, k, BLOCK, None, num_sms)}
        for path, space in spaces.items():
            for cfg in space + [heuristics[path]]:
                fn = runner(cfg)
                try:
                    got = fn(0).float()
                    torch.cuda.synchronize()
                except Exception as e:  # compile (registers, shared memory) or launch failure: skip it
                    trial = (cfg, None, None, f"failed: {_first_line(e)}")
                else:
                    err = ((got - ref).norm() / ref.norm()).item()
                    if not err < TOLERANCE[path]:
                        trial = (cfg, None, err, f"WRONG: rel. error {err:.3g} >= {TOLERANCE[path]}")
                    else:
                        try:
                            trial = (cfg, timed(fn, len(qws)), err, "")
                        except Exception as e:  # e.g. a graph-capture failure: record, go on
                            torch.cuda.synchronize()
                            trial = (cfg, None, err, f"timing failed: {_first_line(e)}")
                if cfg is heuristics[path]:
                    res.heuristic_us[path] = trial[1]
                else:
                    res.trials[path].append(trial)
        results.append(res)
        s, b = res.best("w8a16"), res.best("w8a8")
        print(f"{layer:>13} M={m:<3} bf16 {res.bf16_us:7.1f} us | w8a16 "
              f"{f'{s[0]:7.1f} us {describe(s[1])}' if s else 'none'} | w8a8 "
              f"{f'{b[0]:7.1f} us {describe(b[1])}' if b else 'none'}", flush=True)
    qws = sws = wbf = None  # free this shape's weight copies before the next shape
    torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", default=",".join(map(str, DEFAULT_M)), help="token counts (comma-separated)")
    parser.add_argument("--layers", default="all", help=f"comma-separated subset of {list(SHAPES)}")
    parser.add_argument("--config-dir", default=str(PACKAGE_CONFIG_DIR), help="where the JSON tables go")
    parser.add_argument("--report", default="fp8_gemm_tuning.md", help="markdown report path")
    parser.add_argument("--json", default=None, help="also dump every trial to this JSON file")
    parser.add_argument("--calls", type=int, default=32, help="GEMM calls per captured graph")
    parser.add_argument("--repeats", type=int, default=5, help="graph replays per timing (median)")
    parser.add_argument("--max-seconds", type=float, default=480,
                        help="start no shape that would end after this many seconds (judged by the "
                             "slowest shape so far); finished shapes are kept")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tune_fp8_gemm needs a CUDA GPU")
    layers = list(SHAPES) if args.layers == "all" else args.layers.split(",")
    bad = [name for name in layers if name not in SHAPES]
    if bad:
        raise SystemExit(f"--layers: unknown {bad}; choose from {list(SHAPES)}")
    ms = sorted({int(v) for v in args.m.split(",")})
    if not ms or ms[0] < 1:
        raise SystemExit(f"--m {args.m!r}: give positive token counts, e.g. 1,2,4,8,16,32,64")

    from vllm.benchmarks.timing import copy_bandwidth
    from vllm.model_executor.layers.quantization import fp8_kernels as fk

    device = torch.cuda.get_device_name()
    num_sms = fk._num_sms(torch.device("cuda"))
    copy_gbps = copy_bandwidth() / 1e9
    print(f"{device}: {num_sms} SMs, copy {copy_gbps:.0f} GB/s; tables -> {args.config_dir}", flush=True)
    start = time.perf_counter()
    results, skipped = [], []
    longest_later = 0.0  # the first shape also pays most Triton compiles; later ones hit the cache
    for i, name in enumerate(layers):
        if time.perf_counter() - start + longest_later > args.max_seconds:
            skipped.append(name)
            continue
        n, k = SHAPES[name]
        shape_start = time.perf_counter()
        shape_results = tune_shape(name, n, k, ms, args, num_sms)
        if i > 0:
            longest_later = max(longest_later, time.perf_counter() - shape_start)
        results += shape_results
        for path in write_tables(Path(args.config_dir), device, n, k, *choose_tables(shape_results)):
            print(f"  wrote {path}", flush=True)
    note = f"stopped early (--max-seconds {args.max_seconds:g}): not tuned {skipped}" if skipped else ""
    if note:
        print("WARNING: " + note, flush=True)
    report = render_report(results, device, copy_gbps, time.perf_counter() - start, note)
    Path(args.report).write_text(report, encoding="utf-8")
    print(f"report -> {os.path.abspath(args.report)}", flush=True)
    if args.json:
        dump = [dict(layer=r.layer, n=r.n, k=r.k, m=r.m, bf16_us=r.bf16_us, heuristic_us=r.heuristic_us,
                     trials={p: [dict(config=c.to_json() | {"kernel": c.kernel}, us=us, rel_err=e, note=w)
                                 for c, us, e, w in t] for p, t in r.trials.items()}) for r in results]
        Path(args.json).write_text(json.dumps(dump, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
