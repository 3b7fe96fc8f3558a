"""LLMEngine + executors with a fake worker (no model): exact outputs, streaming, stop strings,
metrics, aborts, and worker failures that must surface as RuntimeErrors instead of hangs."""
import json
import os
import time

import pytest

from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig
from vllm.model_executor.models.tiny import tiny_target_config, write_byte_tokenizer
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.executor.multiproc_executor import MultiprocExecutor

from tests.utils.fake_model import VOCAB, reference_greedy

FAKE = "tests.utils.fake_model.FakeWorker"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fake_model")
    write_byte_tokenizer(str(d))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(tiny_target_config(max_position_embeddings=128), f)
    return str(d)


def make_engine(model_dir, tp=1, dcp=1, num_spec=0, num_blocks=None, worker=FAKE,
                max_model_len=None, **kw):
    spec = (SpeculativeConfig(method="mtp", model=model_dir, num_speculative_tokens=num_spec)
            if num_spec else None)
    cfg = VllmConfig(model_config=ModelConfig(model=model_dir, device="cpu",
                                                       max_model_len=max_model_len),
                     cache_config=CacheConfig(block_size=4, num_gpu_blocks_override=num_blocks),
                     parallel_config=ParallelConfig(tensor_parallel_size=tp,
                                                    decode_context_parallel_size=dcp),
                     speculative_config=spec, **kw)
    return LLMEngine.from_vllm_config(cfg, worker_cls=worker)


def prompts(n):
    return [[(7 * i + 5 * j) % (VOCAB - 10) + 10 for j in range(3 + i % 5)] for i in range(n)]


def drain(engine):
    finals, streamed = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed.setdefault(out.request_id, []).append(list(out.outputs[0].token_ids))
            if out.finished:
                finals[out.request_id] = out
    return finals, streamed


def test_engine_outputs_match_reference_and_stream_cumulatively(model_dir):
    with make_engine(model_dir, num_spec=3) as engine:
        ps = prompts(6)
        for i, p in enumerate(ps):
            engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=12,
                                                          ignore_eos=True))
        finals, streamed = drain(engine)
        for i, p in enumerate(ps):
            out = finals[f"r{i}"]
            assert out.outputs[0].token_ids == reference_greedy(p, 12, eos=None)
            assert out.outputs[0].finish_reason == "length"
            assert out.prompt_token_ids == p
            assert out.outputs[0].text == engine.tokenizer.decode(out.outputs[0].token_ids)
            chunks = streamed[f"r{i}"]
            assert all(a == b[:len(a)] for a, b in zip(chunks, chunks[1:]))  # cumulative
        m = engine.get_metrics()
        spec = m["spec_decode"]
        assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] >= spec["num_drafts"]
        assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"]  # fake drafts err
        assert spec["mean_acceptance_length"] == pytest.approx(
            1 + spec["num_accepted_tokens"] / spec["num_drafts"])
        assert sum(spec["accepted_per_position"]) == spec["num_accepted_tokens"]
        assert len(m["ttft_s"]) == 6 and all(t >= 0 for t in m["ttft_s"])
        assert m["num_requests_running"] == 0 and m["kv_cache_usage"] == 0.0
        assert m["num_generation_tokens"] == 6 * 12


def test_stop_string_finishes_the_request(model_dir):
    with make_engine(model_dir) as engine:
        p = prompts(1)[0]
        ref = reference_greedy(p, 20, eos=None)
        text = engine.tokenizer.decode(ref)
        stop = text[5:7]
        assert text.find(stop) == 5
        engine.add_request("s", p, SamplingParams(temperature=0.0, max_tokens=20, stop=[stop],
                                                  ignore_eos=True))
        finals, _ = drain(engine)
        out = finals["s"].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == text[:5]
        assert engine.get_metrics()["num_free_blocks"] == engine.get_metrics()["num_total_blocks"]


def test_string_prompts_abort_and_bad_input(model_dir):
    with make_engine(model_dir, max_model_len=64) as engine:
        engine.add_request("a", "hello", SamplingParams(temperature=0.0, max_tokens=50))
        engine.add_request("b", [11, 12], SamplingParams(temperature=0.0, max_tokens=50))
        engine.step()
        engine.abort_request("a")
        finals, _ = drain(engine)
        assert set(finals) == {"b"}
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.add_request("c", [1, 99999], SamplingParams())
        with pytest.raises(ValueError, match="max_model_len=64"):
            engine.add_request("d", [5] * 65, SamplingParams())
        with pytest.raises(ValueError, match="max_model_len=64"):  # n=2: both children refused
            engine.add_request("e", [5] * 65, SamplingParams(n=2))
        assert "e" not in engine._parents and "0_e" not in engine._states
        assert not engine.has_unfinished_requests()
        assert engine.get_metrics()["kv_cache_usage"] == 0.0


def test_random_requests_get_distinct_definite_seeds(model_dir):
    with make_engine(model_dir) as engine:
        engine.add_request("x", [10, 11], SamplingParams(temperature=1.0, max_tokens=1))
        engine.add_request("y", [10, 11], SamplingParams(temperature=1.0, max_tokens=1))
        engine.add_request("z", [10, 11], SamplingParams(temperature=1.0, max_tokens=1, seed=77))
        seeds = {r: engine.scheduler.requests[r].sampling_params.seed for r in "xyz"}
        assert seeds["x"] is not None and seeds["x"] != seeds["y"] and seeds["z"] == 77
        drain(engine)


@pytest.mark.slow
def test_multiproc_executor_same_outputs_and_min_blocks(model_dir):
    with make_engine(model_dir, tp=2, dcp=2, num_spec=2) as engine:
        assert isinstance(engine.executor, MultiprocExecutor)
        assert engine.scheduler.kv_cache_manager.num_total_blocks == 1000  # min over ranks
        ps = prompts(4)
        for i, p in enumerate(ps):
            engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=10,
                                                          ignore_eos=True))
        finals, _ = drain(engine)
        for i, p in enumerate(ps):
            assert finals[f"r{i}"].outputs[0].token_ids == reference_greedy(p, 10, eos=None)
        processes = engine.executor.processes
    assert all(not p.is_alive() for p in processes)  # clean shutdown


@pytest.mark.slow
@pytest.mark.parametrize("worker,pattern", [
    ("tests.utils.fake_model.RaisingWorker", r"worker rank 1 raised during `execute_model`(.|\n)*injected failure"),
    ("tests.utils.fake_model.DyingWorker", r"worker rank 1 died during `execute_model` \(exit code 17\)"),
    ("tests.utils.fake_model.HangingPeerWorker", r"worker rank 1 raised(.|\n)*rank 1 gave up"),
])
def test_worker_failure_stops_the_engine_with_an_error_not_a_hang(model_dir, worker, pattern):
    engine = make_engine(model_dir, tp=2, worker=worker)
    processes = engine.executor.processes
    engine.add_request("r", [10, 11, 12], SamplingParams(temperature=0.0, max_tokens=20,
                                                         ignore_eos=True))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=pattern):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 30
    for p in processes:
        p.join(timeout=10)
        assert not p.is_alive()  # the hung rank was terminated too
    with pytest.raises(RuntimeError, match="shut down"):
        engine.step()
    engine.shutdown()


@pytest.mark.slow
def test_worker_failure_at_startup_names_the_rank(model_dir):
    with pytest.raises(RuntimeError, match=r"worker rank \d raised during `start-up`"):
        make_engine(model_dir, tp=2, worker="tests.utils.fake_model.NoSuchWorker")

