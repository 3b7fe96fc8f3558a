"""Driving a real LLMEngine step by step in tests: a greedy request and a loop to completion."""
from vllm.sampling_params import SamplingParams


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_to_completion(engine, finals: dict) -> None:
    """Step until nothing is left; every finished RequestOutput lands in finals[request_id]."""
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
