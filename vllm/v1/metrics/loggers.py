"""Periodic log lines in upstream vLLM's format (vllm/v1/metrics/loggers.py LoggingStatLogger):

    Engine 000: Avg prompt throughput: 12.3 tokens/s, Avg generation throughput: 45.6 tokens/s,
    Running: 2 reqs, Waiting: 0 reqs, GPU KV cache usage: 3.1%, Prefix cache hit rate: 0.0%
    SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 1.20 tokens/s,
    Drafted throughput: 3.00 tokens/s, Accepted: 12 tokens, Drafted: 30 tokens,
    Per-position acceptance rate: 0.800, 0.400, Avg Draft acceptance rate: 40.0%

Rates are over the interval since the previous line (read from the engine's cumulative metrics
snapshot); this engine has no prefix cache, so its hit rate is always 0.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import os
import time
from typing import Any, Callable

logger = logging.getLogger("vllm.v1.metrics.loggers")

# Upstream's VLLM_LOG_STATS_INTERVAL (seconds between lines).
DEFAULT_INTERVAL_S = float(os.environ.get("VLLM_LOG_STATS_INTERVAL", "10"))


class LoggingStatLogger:
    def __init__(self, snapshot_fn: Callable[[], dict[str, Any]], engine_index: int = 0,
                 interval_s: float = DEFAULT_INTERVAL_S):
        self.snapshot_fn = snapshot_fn
        self.engine_index = engine_index
        self.interval_s = interval_s
        self._last: dict[str, Any] = {}
        self._last_time = time.monotonic()

    def lines(self, now: float | None = None) -> list[str]:
        """The lines for the interval ending now (and start the next interval)."""
        now = time.monotonic() if now is None else now
        snap = self.snapshot_fn() or {}
        elapsed = max(now - self._last_time, 1e-9)
        prev = self._last

        def delta(key: str, source=snap, before=prev) -> float:
            return float(source.get(key, 0) or 0) - float(before.get(key, 0) or 0)

        lines = [
            f"Engine {self.engine_index:03d}: "
            f"Avg prompt throughput: {delta('num_prompt_tokens') / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {delta('num_generation_tokens') / elapsed:.1f} tokens/s, "
            f"Running: {int(snap.get('num_requests_running', 0))} reqs, "
            f"Waiting: {int(snap.get('num_requests_waiting', 0))} reqs, "
            f"GPU KV cache usage: {100.0 * float(snap.get('kv_cache_usage', 0.0)):.1f}%, "
            f"Prefix cache hit rate: 0.0%"]
        spec, spec_prev = snap.get("spec_decode") or {}, prev.get("spec_decode") or {}
        drafts = delta("num_drafts", spec, spec_prev)
        if spec and drafts > 0:
            drafted = delta("num_draft_tokens", spec, spec_prev)
            accepted = delta("num_accepted_tokens", spec, spec_prev)
            per_pos_now = list(spec.get("accepted_per_position") or [])
            per_pos_before = list(spec_prev.get("accepted_per_position") or [])
            per_pos_before += [0] * (len(per_pos_now) - len(per_pos_before))
            rates = ", ".join(f"{(a - b) / drafts:.3f}"
                              for a, b in zip(per_pos_now, per_pos_before))
            lines.append(
                f"SpecDecoding metrics: Mean acceptance length: {1.0 + accepted / drafts:.2f}, "
                f"Accepted throughput: {accepted / elapsed:.2f} tokens/s, "
                f"Drafted throughput: {drafted / elapsed:.2f} tokens/s, "
                f"Accepted: {int(accepted)} tokens, Drafted: {int(drafted)} tokens, "
                f"Per-position acceptance rate: {rates}, "
                f"Avg Draft acceptance rate: {100.0 * accepted / max(drafted, 1):.1f}%")
        policy, policy_prev = spec.get("policy") or {}, spec_prev.get("policy") or {}
        if policy and policy.get("mode") != "always":
            # disable_by_batch_size N / "auto": how many request-steps drafted since the last line.
            drafted_steps = delta("num_drafted", policy, policy_prev)
            skipped_prev = policy_prev.get("num_skipped") or {}
            skipped = {reason: n - skipped_prev.get(reason, 0)
                       for reason, n in sorted((policy.get("num_skipped") or {}).items())}
            if drafted_steps > 0 or any(skipped.values()):
                lines.append(
                    f"Speculation policy ({policy['mode']}): drafted {int(drafted_steps)} "
                    f"request-steps, skipped {sum(skipped.values())} ("
                    + ", ".join(f"{reason}: {n}" for reason, n in skipped.items()) + ")")
        self._last = copy.deepcopy(snap)
        self._last_time = now
        return lines

    def log(self) -> None:
        for line in self.lines():
            logger.info("%s", line)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.log()
            except Exception:  # noqa: BLE001 - a stats line must never take the server down
                logger.exception("stat logging failed")
