"""Upstream vLLM's benchmark output formats: the JSON keys and printed lines of
`vllm bench latency | throughput | serve`, so scripts written for upstream parse ours.

Our own fields (nested ttft/tpot/itl summaries, spec-decode acceptance, raw seconds) are kept
next to upstream's keys; the PNG plot is written by results.save_png as before.
"""
from __future__ import annotations

from datetime import datetime
from typing import Any, Sequence

import numpy as np

LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)
_ROW = "{:<40} {:<10}"
_ROW_F = "{:<40} {:<10.2f}"


def _section(title: str, fill: str = "-") -> str:
    return "{s:{c}^{n}}".format(s=title, n=50, c=fill)


# ---- bench latency --------------------------------------------------------------------------------
def latency_result(latencies_s: Sequence[float]) -> dict[str, Any]:
    arr = np.asarray(latencies_s, dtype=np.float64)
    return {"avg_latency": float(arr.mean()) if arr.size else 0.0,
            "latencies": [float(x) for x in arr],
            "percentiles": {str(p): float(np.percentile(arr, p)) if arr.size else 0.0
                            for p in LATENCY_PERCENTILES}}


def latency_lines(result: dict[str, Any]) -> list[str]:
    lines = [f"Avg latency: {result['avg_latency']} seconds"]
    lines += [f"{p}% percentile latency: {v} seconds" for p, v in result["percentiles"].items()]
    return lines


# ---- bench throughput -----------------------------------------------------------------------------
def throughput_result(elapsed_s: float, num_requests: int, num_prompt_tokens: int,
                      num_output_tokens: int) -> dict[str, Any]:
    elapsed_s = max(elapsed_s, 1e-9)
    total = num_prompt_tokens + num_output_tokens
    return {"elapsed_time": elapsed_s, "num_requests": num_requests, "total_num_tokens": total,
            "requests_per_second": num_requests / elapsed_s, "tokens_per_second": total / elapsed_s,
            "total_num_prompt_tokens": num_prompt_tokens,
            "total_num_output_tokens": num_output_tokens}


def throughput_lines(result: dict[str, Any]) -> list[str]:
    elapsed = result["elapsed_time"]
    return [f"Throughput: {result['requests_per_second']:.2f} requests/s, "
            f"{result['tokens_per_second']:.2f} total tokens/s, "
            f"{result['total_num_output_tokens'] / elapsed:.2f} output tokens/s",
            f"Total num prompt tokens:  {result['total_num_prompt_tokens']}",
            f"Total num output tokens:  {result['total_num_output_tokens']}"]


# ---- bench serve ----------------------------------------------------------------------------------
SERVE_METRICS = {"ttft": ("TTFT", "Time to First Token"),
                 "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
                 "itl": ("ITL", "Inter-token Latency"),
                 "e2el": ("E2EL", "End-to-end Latency")}


def _p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def serve_result(summary: dict[str, Any], *, backend: str, model_id: str, tokenizer_id: str,
                 num_prompts: int, request_rate: float, burstiness: float,
                 max_concurrency: int | None, percentile_metrics: Sequence[str],
                 metric_percentiles: Sequence[float], input_lens: list[int],
                 output_lens: list[int], ttfts: list[float], itls: list[list[float]],
                 generated_texts: list[str], errors: list[str], failed: int) -> dict[str, Any]:
    """Upstream's result dict (same keys), from our summary (results.summarize_requests)."""
    raw = summary.get("_raw", {})
    per_metric_s = {"ttft": raw.get("ttft_s", []), "tpot": raw.get("tpot_s", []),
                    "itl": raw.get("itl_s", []), "e2el": raw.get("e2e_s", [])}
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": backend,
        "model_id": model_id, "tokenizer_id": tokenizer_id, "num_prompts": num_prompts,
        "request_rate": request_rate if request_rate != float("inf") else "inf",
        "burstiness": burstiness, "max_concurrency": max_concurrency,
        "duration": summary["duration_s"], "completed": summary["num_requests"],
        "failed": failed, "total_input_tokens": summary["total_prompt_tokens"],
        "total_output_tokens": summary["total_output_tokens"],
        "request_throughput": summary["request_throughput_per_s"], "request_goodput": None,
        "output_throughput": summary["output_throughput_tok_per_s"],
        "total_token_throughput": summary["total_token_throughput_tok_per_s"],
        "input_lens": input_lens, "output_lens": output_lens, "ttfts": ttfts, "itls": itls,
        "generated_texts": generated_texts, "errors": errors,
    }
    for name in percentile_metrics:
        ms = np.asarray(per_metric_s[name], dtype=np.float64) * 1000.0
        result[f"mean_{name}_ms"] = float(ms.mean()) if ms.size else 0.0
        result[f"median_{name}_ms"] = float(np.median(ms)) if ms.size else 0.0
        result[f"std_{name}_ms"] = float(ms.std()) if ms.size else 0.0
        for p in metric_percentiles:
            result[f"p{_p_word(p)}_{name}_ms"] = float(np.percentile(ms, p)) if ms.size else 0.0
    spec = summary.get("spec_decode")
    if spec:
        result["spec_decode_acceptance_rate"] = 100.0 * spec["draft_acceptance_rate"]
        result["spec_decode_acceptance_length"] = spec["mean_acceptance_length"]
        result["spec_decode_num_drafts"] = int(spec["num_drafts"])
        result["spec_decode_draft_tokens"] = int(spec["num_draft_tokens"])
        result["spec_decode_accepted_tokens"] = int(spec["num_accepted_tokens"])
        result["spec_decode_per_position_acceptance_rates"] = list(
            spec["acceptance_rate_per_position"])
    return result


def serve_lines(result: dict[str, Any], percentile_metrics: Sequence[str],
                metric_percentiles: Sequence[float]) -> list[str]:
    lines = [_section(" Serving Benchmark Result ", "="),
             _ROW.format("Successful requests:", result["completed"]),
             _ROW.format("Failed requests:", result["failed"])]
    if result["max_concurrency"] is not None:
        lines.append(_ROW.format("Maximum request concurrency:", result["max_concurrency"]))
    if result["request_rate"] != "inf":
        lines.append(_ROW_F.format("Request rate configured (RPS):", result["request_rate"]))
    lines += [_ROW_F.format("Benchmark duration (s):", result["duration"]),
              _ROW.format("Total input tokens:", result["total_input_tokens"]),
              _ROW.format("Total generated tokens:", result["total_output_tokens"]),
              _ROW_F.format("Request throughput (req/s):", result["request_throughput"]),
              _ROW_F.format("Output token throughput (tok/s):", result["output_throughput"]),
              _ROW_F.format("Total token throughput (tok/s):", result["total_token_throughput"])]
    for name in percentile_metrics:
        short, header = SERVE_METRICS[name]
        lines += [_section(header),
                  _ROW_F.format(f"Mean {short} (ms):", result[f"mean_{name}_ms"]),
                  _ROW_F.format(f"Median {short} (ms):", result[f"median_{name}_ms"])]
        lines += [_ROW_F.format(f"P{_p_word(p)} {short} (ms):", result[f"p{_p_word(p)}_{name}_ms"])
                  for p in metric_percentiles]
    if "spec_decode_acceptance_length" in result:
        lines += [_section("Speculative Decoding"),
                  _ROW_F.format("Acceptance rate (%):", result["spec_decode_acceptance_rate"]),
                  _ROW_F.format("Acceptance length:", result["spec_decode_acceptance_length"]),
                  _ROW.format("Drafts:", result["spec_decode_num_drafts"]),
                  _ROW.format("Draft tokens:", result["spec_decode_draft_tokens"]),
                  _ROW.format("Accepted tokens:", result["spec_decode_accepted_tokens"])]
        rates = result["spec_decode_per_position_acceptance_rates"]
        if rates:
            lines.append("Per-position acceptance (%):")
            lines += [_ROW_F.format(f"  Position {i}:", r * 100) for i, r in enumerate(rates)]
    lines.append("=" * 50)
    return lines


def serve_result_filename(backend: str, request_rate: float, max_concurrency: int | None,
                          model_id: str, label: str | None = None) -> str:
    """Upstream's default --save-result file name."""
    rate = "inf" if request_rate == float("inf") else f"{request_rate}"
    conc = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    base_model = model_id.rstrip("/").split("/")[-1]
    now = datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{label or backend}-{rate}qps{conc}-{base_model}-{now}.json"
