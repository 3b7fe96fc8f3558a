"""vllm/benchmarks/host_stub.py: the fixed-output forward really replaces the model (greedy
decoding then emits the stub's token), for a plain engine and for a speculative engine whose
policy lets nobody draft (the host-cost probes' uses)."""
import pytest

from vllm.benchmarks.host_stub import stub_forward


@pytest.mark.parametrize("spec", [None, {"method": "dspark", "num_speculative_tokens": 4,
                                         "disable_by_batch_size": 1}])
def test_stubbed_forward_drives_greedy_decoding(spec):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine
    engine = LLMEngine.from_engine_args(EngineArgs(max_model_len=64, max_num_seqs=2,
                                                   speculative_config=spec))
    try:
        stub_forward(engine.executor.worker.model_runner, token=11)
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        engine.add_request("a", [5, 9, 13], params)
        engine.add_request("b", [2, 4], params)
        final = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                final[out.request_id] = out.outputs[0].token_ids
        assert final == {"a": [11] * 6, "b": [11] * 6}  # the stub's logits peak at token 11
    finally:
        engine.shutdown()
