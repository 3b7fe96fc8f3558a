"""Summaries of benchmark runs: latency percentiles, throughputs, acceptance, JSON and PNG output."""
from __future__ import annotations

import json
import os
from typing import Any, Sequence

import numpy as np

from vllm.v1.metrics.stats import RequestTimer

PERCENTILES = (50, 90, 99)


def describe_ms(values_s: Sequence[float]) -> dict[str, float]:
    """mean / median / p90 / p99 / max in milliseconds (all 0.0 for an empty list)."""
    if len(values_s) == 0:
        return {"mean_ms": 0.0, "median_ms": 0.0, "p90_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0,
                "count": 0}
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    return {"mean_ms": float(arr.mean()), "median_ms": float(np.percentile(arr, 50)),
            "p90_ms": float(np.percentile(arr, 90)), "p99_ms": float(np.percentile(arr, 99)),
            "max_ms": float(arr.max()), "count": int(arr.size)}


def summarize_requests(timers: Sequence[RequestTimer], duration_s: float,
                       num_prompt_tokens: int) -> dict[str, Any]:
    num_output = sum(t.num_generation_tokens for t in timers)
    ttfts = [t.ttft for t in timers if t.ttft is not None]
    tpots = [t.tpot for t in timers if t.tpot is not None]
    e2e = [t.e2e_latency for t in timers if t.e2e_latency is not None]
    itls = [gap for t in timers for gap in t.inter_token_latencies()]
    duration_s = max(duration_s, 1e-9)
    return {
        "num_requests": len(timers),
        "duration_s": duration_s,
        "total_prompt_tokens": int(num_prompt_tokens),
        "total_output_tokens": int(num_output),
        "request_throughput_per_s": len(timers) / duration_s,
        "output_throughput_tok_per_s": num_output / duration_s,
        "total_token_throughput_tok_per_s": (num_output + num_prompt_tokens) / duration_s,
        "ttft": describe_ms(ttfts),
        "tpot": describe_ms(tpots),
        "itl": describe_ms(itls),
        "e2e_latency": describe_ms(e2e),
        "_raw": {"ttft_s": ttfts, "tpot_s": tpots, "itl_s": itls, "e2e_s": e2e},
    }


def format_summary(title: str, summary: dict[str, Any]) -> str:
    lines = [f"============ {title} ============"]
    lines.append(f"requests: {summary['num_requests']}   duration: {summary['duration_s']:.3f} s")
    if "latency" in summary:
        lat = summary["latency"]
        lines.append(f"batch latency: mean {lat['mean_ms']:.1f} ms, median {lat['median_ms']:.1f} ms,"
                     f" p99 {lat['p99_ms']:.1f} ms over {lat['count']} iterations")
    lines.append(f"throughput: {summary['request_throughput_per_s']:.2f} req/s, "
                 f"{summary['output_throughput_tok_per_s']:.1f} output tok/s, "
                 f"{summary['total_token_throughput_tok_per_s']:.1f} total tok/s")
    for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e_latency", "E2E")):
        d = summary[key]
        lines.append(f"{label:>4}: mean {d['mean_ms']:8.2f} ms   median {d['median_ms']:8.2f} ms   "
                     f"p99 {d['p99_ms']:8.2f} ms")
    spec = summary.get("spec_decode")
    if spec is None:
        lines.append("speculative decoding: off")
    else:
        rates = ", ".join(f"{r:.2f}" for r in spec["acceptance_rate_per_position"])
        lines.append(f"mean acceptance length: {spec['mean_acceptance_length']:.3f}   "
                     f"draft acceptance: {100 * spec['draft_acceptance_rate']:.1f}%   "
                     f"per position: [{rates}]")
    return "\n".join(lines)


def save_json(path: str, summary: dict[str, Any], args: dict[str, Any] | None = None) -> None:
    payload = {k: v for k, v in summary.items() if k != "_raw"}
    payload["raw_seconds"] = summary.get("_raw", {})
    if args is not None:
        payload["args"] = {k: v for k, v in args.items() if _jsonable(v)}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2)


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def save_png(path: str, title: str, summary: dict[str, Any]) -> None:
    """Histograms of TTFT / TPOT / ITL and, with speculative decoding, acceptance per position."""
    import matplotlib

    matplotlib.use("Agg")  # headless: never needs a display
    import matplotlib.pyplot as plt

    raw = summary.get("_raw", {})
    spec = summary.get("spec_decode")
    panels = [("TTFT", raw.get("ttft_s", [])), ("TPOT", raw.get("tpot_s", [])),
              ("ITL", raw.get("itl_s", []))]
    if raw.get("latency_s"):
        panels.append(("batch latency", raw["latency_s"]))
    ncols = len(panels) + (1 if spec else 0)
    fig, axes = plt.subplots(1, ncols, figsize=(4 * ncols, 3.4))
    for ax, (name, values) in zip(axes, panels):
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        if ms.size:
            ax.hist(ms, bins=min(30, max(5, ms.size // 2)), color="#3b75af")
            ax.axvline(float(np.median(ms)), color="#d62728", linestyle="--", label="median")
            ax.legend(fontsize=8)
        ax.set_title(f"{name} ({ms.size} samples)")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("count")
    if spec:
        ax = axes[-1]
        rates = spec["acceptance_rate_per_position"]
        ax.bar([str(i) for i in range(len(rates))], rates, color="#2ca02c")
        ax.set_ylim(0, 1)
        ax.set_title(f"acceptance (mean len {spec['mean_acceptance_length']:.2f})")
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance rate")
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
