from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.request import Request
from vllm.v1.core.sched.scheduler import Scheduler

from tests.utils.fake_model import EOS, FakeRunner


def make_config(max_model_len=256, block_size=4, dcp=1, num_spec=0, max_num_seqs=16,
                max_num_batched_tokens=512, enable_chunked_prefill=True):
    spec = (SpeculativeConfig(method="eagle", model="unused", num_speculative_tokens=num_spec)
            if num_spec else None)
    return VllmConfig(model_config=ModelConfig(model=None, max_model_len=max_model_len),
                      cache_config=CacheConfig(block_size=block_size),
                      parallel_config=ParallelConfig(tensor_parallel_size=dcp,
                                                     decode_context_parallel_size=dcp),
                      speculative_config=spec, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens,
                      enable_chunked_prefill=enable_chunked_prefill)


def make_request(rid, prompt, max_tokens=16, **params):
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
    return Request(request_id=rid, prompt_token_ids=prompt, sampling_params=sp, eos_token_id=EOS,
                   max_tokens=max_tokens)


def run_to_completion(scheduler: Scheduler, runner: FakeRunner, max_steps=10_000):
    """Step until done; return {req_id: output tokens} and the finish reasons."""
    outputs, reasons = {}, {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs, reasons
        so = scheduler.schedule()
        ro = runner.execute_model(so)
        for core in scheduler.update_from_output(so, ro):
            outputs.setdefault(core.request_id, []).extend(core.new_token_ids)
            if core.finished:
                reasons[core.request_id] = core.finish_reason
    raise AssertionError("scheduler did not finish (livelock?)")
