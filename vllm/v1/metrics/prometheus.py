"""Prometheus metrics of one served model (names follow upstream vLLM's `vllm:` prefix).

Two sources feed it:
* request timings observed by AsyncLLM as outputs stream out (histograms and counters updated live);
* the engine's own cumulative state (`LLMEngine.get_metrics()`): queue sizes, KV cache usage and
  speculative-decoding counters. Those are read from the latest snapshot at scrape time by a
  custom collector, so the exporter never touches the engine from the HTTP thread.

Each exporter owns a private CollectorRegistry so several servers (or tests) can live in one process.
Every series carries upstream's labels `model_name` and `engine` (the engine index, "0"); like
upstream, the `*_created` series are off.
"""
from __future__ import annotations

from typing import Any, Callable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from vllm.v1.metrics.stats import RequestTimer, mean_acceptance_length
from vllm.v1.spec_decode.cost_model import REASON_BATCH, REASON_COST, REASON_EXPLORE

# Upstream vLLM turns the `*_created` samples off (they double every counter / histogram).
prometheus_client.disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Latency buckets in seconds: CPU runs of the tiny model sit at the low end, big models at the high end.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5, 5.0)
# Request phase times (queue / prefill / decode / inference), upstream's bucket shape.
_PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                  20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Tokens per engine step and per request: 1-2-5 steps up to 1M (upstream's build_1_2_5_buckets).
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5) if m * 10**e <= 10**6)
ENGINE_INDEX = "0"
# Every reason label is exported from the start (at 0), so rate() sees the series appear.
_POLICY_REASONS = (REASON_BATCH, REASON_COST, REASON_EXPLORE)


class _EngineStateCollector:
    """Exports the engine's cumulative metrics snapshot at scrape time."""

    def __init__(self, snapshot_fn: Callable[[], dict[str, Any]], model_name: str):
        self._snapshot_fn = snapshot_fn
        self._model_name = model_name

    def collect(self):
        snapshot = self._snapshot_fn() or {}
        labels = ["model_name", "engine"]
        values = [self._model_name, ENGINE_INDEX]

        def gauge(name, doc, value):
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, float(value))
            return family

        yield gauge("vllm:num_requests_running", "Requests in the running batch.",
                    snapshot.get("num_requests_running", 0))
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                    snapshot.get("num_requests_waiting", 0))
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).",
                    snapshot.get("kv_cache_usage", 0.0))
        if "num_free_blocks" in snapshot:
            yield gauge("vllm:kv_cache_free_blocks", "Free KV cache blocks.", snapshot["num_free_blocks"])
        if "num_total_blocks" in snapshot:
            yield gauge("vllm:kv_cache_total_blocks", "Total KV cache blocks.", snapshot["num_total_blocks"])

        def counter(name, doc, value):
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, float(value))
            return family

        yield counter("vllm:num_preemptions", "Cumulative number of preemptions (recompute).",
                      snapshot.get("num_preemptions", 0))
        spec = snapshot.get("spec_decode")
        if not spec:
            return

        num_drafts = int(spec.get("num_drafts", 0))
        num_accepted = int(spec.get("num_accepted_tokens", 0))
        yield counter("vllm:spec_decode_num_drafts", "Verification steps that carried drafts.", num_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.",
                      spec.get("num_draft_tokens", 0))
        yield counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", num_accepted)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted draft tokens by position in the draft.",
                                      labels=labels + ["position"])
        for position, count in enumerate(spec.get("accepted_per_position", []) or []):
            per_pos.add_metric(values + [str(position)], float(count))
        yield per_pos
        yield gauge("vllm:spec_decode_mean_acceptance_length",
                    "Tokens gained per verification step (1 + accepted drafts per step).",
                    spec.get("mean_acceptance_length", mean_acceptance_length(num_drafts, num_accepted)))
        policy = spec.get("policy")
        if policy:
            # The speculation policy's per-request decisions (disable_by_batch_size N / "auto").
            yield counter("vllm:spec_decode_policy_drafted",
                          "Decode request-steps the speculation policy let draft.",
                          policy.get("num_drafted", 0))
            skipped = CounterMetricFamily(
                "vllm:spec_decode_policy_skipped",
                "Decode request-steps the speculation policy kept from drafting, by reason "
                "(batch_size: disable_by_batch_size; cost: drafting does not pay; explore: a "
                "plain step timed for the cost model).", labels=labels + ["reason"])
            counts = policy.get("num_skipped", {}) or {}
            for reason in sorted(set(_POLICY_REASONS) | set(counts)):
                skipped.add_metric(values + [reason], float(counts.get(reason, 0)))
            yield skipped


class PrometheusMetrics:
    def __init__(self, model_name: str, engine_snapshot_fn: Callable[[], dict[str, Any]]):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self._labels = (model_name, ENGINE_INDEX)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labelnames=labels, buckets=buckets, registry=self.registry)

        self._queue = histogram("vllm:request_queue_time_seconds",
                                "Time in the WAITING phase (arrival to first scheduled).",
                                _PHASE_BUCKETS)
        self._prefill = histogram("vllm:request_prefill_time_seconds",
                                  "Time in the PREFILL phase (first scheduled to first token).",
                                  _PHASE_BUCKETS)
        self._decode = histogram("vllm:request_decode_time_seconds",
                                 "Time in the DECODE phase (first token to last token).",
                                 _PHASE_BUCKETS)
        self._inference = histogram("vllm:request_inference_time_seconds",
                                    "Time in the RUNNING phase (first scheduled to last token).",
                                    _PHASE_BUCKETS)
        self._iteration_tokens = histogram("vllm:iteration_tokens_total",
                                           "Prompt + generation tokens per engine step.",
                                           _TOKEN_BUCKETS)
        self._request_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                                "Prompt tokens per finished request.",
                                                _TOKEN_BUCKETS)
        self._request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                    "Generated tokens per finished request.",
                                                    _TOKEN_BUCKETS)
        self._request_success = Counter(
            "vllm:request_success", "Finished requests by finish reason.",
            labelnames=labels + ["finished_reason"], registry=self.registry)
        self._requests_aborted = Counter(
            "vllm:request_aborted", "Requests aborted before finishing (client went away).",
            labelnames=labels, registry=self.registry)
        self._prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of admitted requests.",
                                      labelnames=labels, registry=self.registry)
        self._generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.",
                                          labelnames=labels, registry=self.registry)
        self._ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                               labelnames=labels, buckets=_TTFT_BUCKETS, registry=self.registry)
        self._tpot = Histogram("vllm:request_time_per_output_token_seconds",
                               "Mean time per output token after the first, per request.",
                               labelnames=labels, buckets=_TPOT_BUCKETS, registry=self.registry)
        self._itl = Histogram("vllm:inter_token_latency_seconds", "Gap between consecutive tokens.",
                              labelnames=labels, buckets=_TPOT_BUCKETS, registry=self.registry)
        self._e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.",
                              labelnames=labels, buckets=_TTFT_BUCKETS, registry=self.registry)
        self.registry.register(_EngineStateCollector(engine_snapshot_fn, model_name))

    def record_admitted(self, num_prompt_tokens: int) -> None:
        self._prompt_tokens.labels(*self._labels).inc(num_prompt_tokens)

    def record_tokens(self, timer: RequestTimer, num_new_tokens: int) -> None:
        """Call after `timer.record_tokens(...)` for the same burst."""
        if num_new_tokens <= 0:
            return
        self._generation_tokens.labels(*self._labels).inc(num_new_tokens)
        if not timer.bursts:
            self._ttft.labels(*self._labels).observe(timer.ttft)
        else:
            gap, count = timer.bursts[-1]
            itl = self._itl.labels(*self._labels)
            for _ in range(count):
                itl.observe(gap / count)

    def record_iteration(self, num_tokens: int) -> None:
        """Tokens one engine step processed (prompt tokens prefilled + tokens generated)."""
        if num_tokens > 0:
            self._iteration_tokens.labels(*self._labels).observe(num_tokens)

    def record_phases(self, phases: dict | None) -> None:
        """Engine-side timestamps of a finished request (RequestOutput.metrics)."""
        if not phases:
            return
        arrival, scheduled = phases.get("arrival_time"), phases.get("first_scheduled_time")
        first, last = phases.get("first_token_time"), phases.get("last_token_time")
        if arrival is not None and scheduled is not None:
            self._queue.labels(*self._labels).observe(max(scheduled - arrival, 0.0))
        if scheduled is not None and first is not None:
            self._prefill.labels(*self._labels).observe(max(first - scheduled, 0.0))
        if first is not None and last is not None:
            self._decode.labels(*self._labels).observe(max(last - first, 0.0))
        if scheduled is not None and last is not None:
            self._inference.labels(*self._labels).observe(max(last - scheduled, 0.0))

    def record_finished(self, timer: RequestTimer, finish_reason: str | None,
                        phases: dict | None = None) -> None:
        self._request_success.labels(*self._labels, finish_reason or "unknown").inc()
        self._request_prompt_tokens.labels(*self._labels).observe(timer.num_prompt_tokens)
        self._request_generation_tokens.labels(*self._labels).observe(timer.num_generation_tokens)
        self.record_phases(phases)
        if timer.tpot is not None:
            self._tpot.labels(*self._labels).observe(timer.tpot)
        if timer.e2e_latency is not None:
            self._e2e.labels(*self._labels).observe(timer.e2e_latency)

    def record_aborted(self) -> None:
        self._requests_aborted.labels(*self._labels).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
