"""`vllm bench serve`: load a running OpenAI-compatible server and measure what clients see.

Requests stream from /v1/completions (ignore_eos, greedy, exactly --output-len tokens); TTFT is
the time to the first non-empty text chunk, ITL the gap between chunks, TPOT (last-first)/(n-1)
with n from the server's `usage`. Arrivals are Poisson at --request-rate (inf = all at once),
capped by --max-concurrency. Acceptance length comes from the server's /metrics counters, read
before and after the run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time

from vllm.benchmarks.datasets import random_text_prompts
from vllm.benchmarks.offline import spec_decode_delta
from vllm.benchmarks.offline_bench import add_common_args, finish_report
from vllm.benchmarks.results import summarize_requests
from vllm.benchmarks.upstream_format import (SERVE_METRICS, serve_lines, serve_result,
                                             serve_result_filename)
from vllm.v1.metrics.stats import RequestTimer


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser)
    parser.add_argument("--backend", default="vllm", choices=["vllm", "openai"],
                        help="both stream /v1/completions (upstream names)")
    parser.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions"])
    parser.add_argument("--base-url", default=None,
                        help="server URL (default http://HOST:PORT)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    parser.add_argument("--served-model-name", default=None,
                        help="name sent as `model` (default: --model)")
    parser.add_argument("--tokenizer", default=None, help="recorded as tokenizer_id")
    parser.add_argument("--dataset-name", default="random", choices=["random"],
                        help="random word prompts of --random-input-len (no dataset downloads)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second (default inf = all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the inter-arrival times (1 = Poisson)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true",
                        help="generate exactly --random-output-len tokens")
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                        help="comma list of ttft, tpot, itl, e2el")
    parser.add_argument("--metric-percentiles", default="99", help="comma list, e.g. 50,90,99")
    parser.add_argument("--save-result", action="store_true",
                        help="write the upstream-format JSON to --result-dir/--result-filename")
    parser.add_argument("--result-dir", default=None, help="directory for --save-result")
    parser.add_argument("--result-filename", default=None,
                        help="file name for --save-result (default: upstream's pattern)")
    parser.add_argument("--label", default=None, help="prefix of the default result file name")
    parser.add_argument("--timeout", type=float, default=300.0, help="per-request timeout (s)")


def parse_spec_counters(metrics_text: str) -> dict | None:
    """Speculative-decoding counters from Prometheus text (None if the server has none)."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict = {}
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                per_pos[int(sample.labels["position"])] = sample.value
            elif name.startswith("vllm:spec_decode_num_"):
                found[name.removeprefix("vllm:spec_decode_")] = sample.value
    if "num_drafts" not in found:
        return None
    found["accepted_per_position"] = [per_pos[i] for i in sorted(per_pos)]
    return found


async def _one_request(client, url, model, prompt, output_len, timeout, temperature=0.0,
                       ignore_eos=True):
    timer = RequestTimer()
    body = {"model": model, "prompt": prompt, "max_tokens": output_len,
            "temperature": temperature, "ignore_eos": ignore_eos, "stream": True,
            "stream_options": {"include_usage": True}}
    usage = None
    texts = []
    async with client.stream("POST", url, json=body, timeout=timeout) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            raise RuntimeError(f"HTTP {response.status_code}: {text[:200]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(chunk["error"].get("message", "stream error"))
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    timer.record_tokens(1)
                    texts.append(choice["text"])
    if usage is None:
        raise RuntimeError("the server sent no usage chunk; cannot count tokens")
    # chunks were counted as 1 token each; the true token count comes from usage
    timer.num_generation_tokens = int(usage["completion_tokens"])
    timer.num_prompt_tokens = int(usage["prompt_tokens"])
    timer.generated_text = "".join(texts)
    return timer


async def _benchmark(args) -> dict:
    import httpx

    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    async with httpx.AsyncClient(timeout=args.timeout) as client:
        try:
            model = (args.served_model_name or args.model
                     or (await client.get(f"{base}/v1/models")).json()["data"][0]["id"])
            before = parse_spec_counters((await client.get(f"{base}/metrics")).text)
        except httpx.HTTPError as error:
            raise ValueError(f"cannot reach the server at {base} ({error!r}); start it with "
                             "`vllm serve` or pass --base-url") from None
        prompts = random_text_prompts(args.num_prompts, args.input_len, args.seed)
        semaphore = asyncio.Semaphore(args.max_concurrency)
        rng = random.Random(args.seed)
        failures: list[str] = []

        async def limited(prompt, delay):
            await asyncio.sleep(delay)
            async with semaphore:
                try:
                    return await _one_request(client, f"{base}{args.endpoint}", model, prompt,
                                              args.output_len, args.timeout, args.temperature,
                                              args.ignore_eos)
                except Exception as error:  # noqa: BLE001 - counted and reported
                    failures.append(repr(error))
                    return None

        delays, t = [], 0.0
        for _ in prompts:
            delays.append(t)
            if args.request_rate != float("inf"):
                # Gamma inter-arrivals with mean 1/rate; shape = burstiness (1 = Poisson).
                t += rng.gammavariate(args.burstiness, 1.0 / (args.request_rate * args.burstiness))
        start = time.perf_counter()
        timers = await asyncio.gather(*(limited(p, d) for p, d in zip(prompts, delays)))
        duration = time.perf_counter() - start
        after = parse_spec_counters((await client.get(f"{base}/metrics")).text)
    done = [t for t in timers if t is not None]
    summary = summarize_requests(done, duration, sum(t.num_prompt_tokens for t in done))
    summary["num_failed"] = len(failures)
    summary["failures"] = failures[:10]
    summary["spec_decode"] = spec_decode_delta(before, after)
    summary["model"] = model
    summary["_done"] = done
    return summary


def run_serve_bench(args: argparse.Namespace) -> dict:
    for name in ("input_len", "output_len", "num_prompts", "max_concurrency"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = [m for m in metrics if m not in SERVE_METRICS]
    if unknown:
        raise ValueError(f"--percentile-metrics has unknown metric(s) {unknown}; use "
                         f"{list(SERVE_METRICS)}")
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles {args.metric_percentiles!r} must be a comma "
                         "list of numbers, e.g. 50,90,99") from None
    if args.burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
    summary = asyncio.run(_benchmark(args))
    done = summary.pop("_done")
    upstream = serve_result(
        summary, backend=args.backend, model_id=args.model or summary["model"],
        tokenizer_id=args.tokenizer or args.model or summary["model"],
        num_prompts=args.num_prompts, request_rate=args.request_rate,
        burstiness=args.burstiness, max_concurrency=args.max_concurrency,
        percentile_metrics=metrics, metric_percentiles=percentiles,
        input_lens=[t.num_prompt_tokens for t in done],
        output_lens=[t.num_generation_tokens for t in done],
        ttfts=[t.ttft for t in done], itls=[t.inter_token_latencies() for t in done],
        generated_texts=[getattr(t, "generated_text", "") for t in done],
        errors=summary["failures"], failed=summary["num_failed"])
    summary.update({k: v for k, v in upstream.items() if k not in summary})
    summary = finish_report(args, f"serve: {summary['model']}, {args.num_prompts} prompts", summary,
                            serve_lines(upstream, metrics, percentiles))
    if args.save_result:
        name = args.result_filename or serve_result_filename(
            args.backend, args.request_rate, args.max_concurrency, upstream["model_id"], args.label)
        path = os.path.join(args.result_dir or ".", name)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(upstream, f, indent=2)
        print(f"saved {path}")
    if summary["num_failed"]:
        print(f"{summary['num_failed']} requests failed, e.g. {summary['failures'][0]}")
    return summary
