"""Drive an LLMEngine over a list of prompts while timing every request.

Shared by `vllm generate` and the offline benchmarks: it adds all prompts up front (the engine
batches them), steps until everything finished, and keeps a RequestTimer per request so callers
get TTFT / TPOT / ITL without a second code path. A tqdm bar counts finished requests.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

from tqdm import tqdm

from vllm.v1.metrics.stats import RequestTimer, mean_acceptance_length, per_position_acceptance


@dataclass
class OfflineResult:
    request_id: str
    prompt: str | list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    timer: RequestTimer


def run_requests(engine, prompts: Sequence[str | list[int]], params, *, progress: bool = True,
                 desc: str = "Generating", id_prefix: str = "offline") -> list[OfflineResult]:
    """`params`: one SamplingParams for all prompts or a list with one per prompt."""
    params_list = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(params_list) != len(prompts):
        raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts; "
                         "pass one, or one per prompt")
    timers: dict[str, RequestTimer] = {}
    seen: dict[str, int] = {}
    order: list[str] = []
    finals: dict[str, Any] = {}
    for index, (prompt, sampling) in enumerate(zip(prompts, params_list)):
        request_id = f"{id_prefix}-{index}"
        timers[request_id] = RequestTimer()
        seen[request_id] = 0
        order.append(request_id)
        engine.add_request(request_id, prompt, sampling)
    bar = tqdm(total=len(prompts), desc=desc, unit="req", disable=not progress, leave=False)
    try:
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            for output in outputs:
                if output.request_id not in timers:
                    continue
                num_tokens = sum(len(c.token_ids) for c in output.outputs)  # all n samples
                timers[output.request_id].record_tokens(num_tokens - seen[output.request_id], now)
                seen[output.request_id] = num_tokens
                if output.finished:
                    finals[output.request_id] = output
                    bar.update(1)
    finally:
        bar.close()
    results = []
    for request_id, prompt in zip(order, prompts):
        output = finals.get(request_id)
        if output is None:
            raise RuntimeError(f"request {request_id} never finished although the engine drained; "
                               "this is an engine bug")
        completion = output.outputs[0]
        results.append(OfflineResult(request_id, prompt, completion.text, list(completion.token_ids),
                                     completion.finish_reason, timers[request_id]))
    return results


def spec_decode_delta(before: dict | None, after: dict | None) -> dict[str, Any] | None:
    """Acceptance statistics between two `get_metrics()["spec_decode"]` snapshots (None: no SD)."""
    if not after:
        return None
    before = before or {}
    drafts = int(after.get("num_drafts", 0)) - int(before.get("num_drafts", 0))
    draft_tokens = int(after.get("num_draft_tokens", 0)) - int(before.get("num_draft_tokens", 0))
    accepted = int(after.get("num_accepted_tokens", 0)) - int(before.get("num_accepted_tokens", 0))
    per_after = list(after.get("accepted_per_position", []) or [])
    per_before = list(before.get("accepted_per_position", []) or [])
    per_before += [0] * (len(per_after) - len(per_before))
    per_pos = [a - b for a, b in zip(per_after, per_before)]
    return {
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "accepted_per_position": per_pos,
        "mean_acceptance_length": mean_acceptance_length(drafts, accepted),
        "acceptance_rate_per_position": per_position_acceptance(drafts, per_pos),
        "draft_acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
    }


def format_spec_stats(spec: dict[str, Any] | None) -> list[str]:
    if spec is None:
        return ["speculative decoding: off"]
    rates = ", ".join(f"{r:.2f}" for r in spec["acceptance_rate_per_position"])
    return [
        f"mean acceptance length: {spec['mean_acceptance_length']:.3f} tokens per verification step "
        f"({spec['num_accepted_tokens']} of {spec['num_draft_tokens']} draft tokens accepted over "
        f"{spec['num_drafts']} steps, {100 * spec['draft_acceptance_rate']:.1f}%)",
        f"acceptance rate per draft position: [{rates}]",
    ]
