"""Async scheduling (step N+1 scheduled and launched before step N's ids reach the host) changes
nothing that is sampled: on the tiny model (CPU, the real runner) outputs equal the synchronous
engine's for greedy and seeded sampling, with chunked prefill, requests arriving mid-run, EOS /
stop-token / stop-string finishes, max_tokens, preemption under a small KV pool, and requests
whose sampling needs host token history (penalties, logprobs: those steps complete in place).
The launch order is checked too: step N+1 is launched before step N is collected."""
from __future__ import annotations

import pytest

from tests.utils.engine_steps import record_launches, run_with_arrivals
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.models.tiny import write_tiny_models
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def tiny():
    return write_tiny_models()


def make_engine(tiny, async_scheduling: bool, **kw) -> LLMEngine:
    args = dict(model=tiny.target, device="cpu", attention_backend="TORCH_MLA", seed=0,
                max_num_seqs=8, max_num_batched_tokens=16, block_size=4,
                async_scheduling=async_scheduling)
    args.update(kw)
    return LLMEngine.from_engine_args(EngineArgs(**args))


PROMPTS = {
    "a": [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100],
    "b": [84, 104, 101, 32, 113],
    "c": [(7 * i + 11) % 250 + 4 for i in range(23)],  # longer than the 16-token budget
    "d": [65],
}


def run(engine, requests, arrivals=None) -> dict:
    return run_with_arrivals(engine, requests, arrivals)


def both(tiny, requests, arrivals=None, **kw):
    results = []
    for mode in (False, True):
        with make_engine(tiny, mode, **kw) as engine:
            results.append(run(engine, requests, arrivals))
    return results


def test_greedy_equals_sync_with_chunks_arrivals_and_lengths(tiny):
    requests = {rid: (p, SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True))
                for i, (rid, p) in enumerate(PROMPTS.items())}
    sync, overlapped = both(tiny, requests, arrivals={"c": 2, "d": 5})
    assert overlapped == sync
    assert all(len(sync[r][0]) == 6 + 3 * i for i, r in enumerate(PROMPTS))


def test_seeded_sampling_equals_sync(tiny):
    requests = {rid: (p, SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=12,
                                        ignore_eos=True))
                for i, (rid, p) in enumerate(PROMPTS.items())}
    sync, overlapped = both(tiny, requests, arrivals={"b": 1, "d": 3})
    assert overlapped == sync


def test_stops_equal_sync(tiny):
    # Stop token / stop string / EOS finish a request one step before async scheduling knows:
    # the extra step's token must not leak into the output.
    greedy = {rid: (p, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
              for rid, p in PROMPTS.items()}
    with make_engine(tiny, False) as engine:
        free_run = run(engine, greedy)
    stop_tok = free_run["a"][0][4]
    text_b = free_run["b"][2]
    requests = {
        "a": (PROMPTS["a"], SamplingParams(temperature=0.0, max_tokens=20,
                                           stop_token_ids=[stop_tok])),
        "b": (PROMPTS["b"], SamplingParams(temperature=0.0, max_tokens=20,
                                           stop=[text_b[3:6]] if len(text_b) >= 6 else None)),
        "c": (PROMPTS["c"], SamplingParams(temperature=0.0, max_tokens=20)),  # EOS allowed
        "d": (PROMPTS["d"], SamplingParams(temperature=0.0, max_tokens=1)),
    }
    sync, overlapped = both(tiny, requests)
    assert overlapped == sync
    assert sync["a"][1] == "stop" and sync["a"][0][-1] == stop_tok
    assert len(sync["d"][0]) == 1


def test_preemption_equals_sync(tiny):
    # 16 blocks of 4 tokens cannot hold all four requests at full length: some are preempted
    # (recomputed) while a step of theirs may be in flight.
    requests = {rid: (p, SamplingParams(temperature=0.7, seed=7 + i, max_tokens=24,
                                        ignore_eos=True))
                for i, (rid, p) in enumerate(PROMPTS.items())}
    with make_engine(tiny, False, num_gpu_blocks_override=16, max_model_len=56) as engine:
        sync = run(engine, requests)
        assert engine.scheduler.num_preemptions > 0
    with make_engine(tiny, True, num_gpu_blocks_override=16, max_model_len=56) as engine:
        overlapped = run(engine, requests)
        assert engine.scheduler.num_preemptions > 0
    assert overlapped == sync


def test_host_token_features_equal_sync(tiny):
    # Penalties read the token history and logprobs go back to the host: these steps complete
    # in place, while plain requests beside them overlap.
    requests = {
        "a": (PROMPTS["a"], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                           repetition_penalty=1.3, frequency_penalty=0.5)),
        "b": (PROMPTS["b"], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                           logprobs=2)),
        "c": (PROMPTS["c"], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)),
    }
    results = []
    for mode in (False, True):
        with make_engine(tiny, mode) as engine:
            finals = {}
            pending = dict(requests)
            step = 0
            while pending or engine.has_unfinished_requests():
                if step == 4 and "a" in pending:  # penalties join a batch that overlaps
                    engine.add_request("a", *pending.pop("a"))
                for rid in [r for r in pending if r != "a"]:
                    engine.add_request(rid, *pending.pop(rid))
                for out in engine.step():
                    if out.finished:
                        finals[out.request_id] = out
                step += 1
            results.append({r: (list(o.outputs[0].token_ids),
                                [sorted(d.items()) for d in (o.outputs[0].logprobs or [])])
                            for r, o in finals.items()})
    assert results[1] == results[0]
    assert len(results[0]["b"][1]) == 10


def test_step_n_plus_1_is_launched_before_step_n_is_collected(tiny):
    with make_engine(tiny, True) as engine:
        events = record_launches(engine)
        run(engine, {"a": (PROMPTS["a"], SamplingParams(temperature=0.0, max_tokens=8,
                                                        ignore_eos=True))})
    launches = [e for e in events if e[0] == "launch"]
    # (record_launches: e[2] = done at launch, e[4] = tokens.) Prefill + 7 decode steps; the
    # in-flight 8th token is known to be the last (max_tokens), so no further step computes
    # anything (a trailing empty step only hands over finished ids).
    assert [e[4] for e in launches if e[4] > 0] == [11] + [1] * 7
    # Steps with tokens return before their ids are on the host ...
    assert all(not e[2] for e in launches if e[4] > 0)
    # ... and every step N is collected after step N+1 was launched (except the last).
    order = [(e[0], e[1]) for e in events]
    for n in range(len(launches) - 1):
        assert order.index(("launch", n + 1)) < order.index(("collect", n))


def test_refused_combinations_name_the_fix(tiny):
    spec = {"method": "dspark", "model": tiny.dspark, "num_speculative_tokens": 4}
    # A drafter: accepted when asked for (its steps without drafts overlap). By default on only
    # where a step can overlap: a block drafter (DSpark / DFlash) under a policy.
    assert EngineArgs(model=tiny.target, device="cpu", async_scheduling=True,
                      speculative_config=dict(spec)).create_engine_config().async_scheduling
    assert not EngineArgs(model=tiny.target, device="cpu",
                          speculative_config=dict(spec)).create_engine_config().async_scheduling
    for method, policy, expected in (("dspark", "auto", True), ("dspark", 4, True),
                                     ("dflash", "auto", True), ("eagle", "auto", False),
                                     ("mtp", 4, False)):
        config = EngineArgs(model=tiny.target, device="cpu", speculative_config={
            "method": method, "model": getattr(tiny, method), "num_speculative_tokens": 3,
            "disable_by_batch_size": policy}).create_engine_config()
        assert config.async_scheduling is expected, (method, policy)
    assert not EngineArgs(model=tiny.target, device="cpu", async_scheduling=False,
                          speculative_config=dict(spec, disable_by_batch_size="auto")
                          ).create_engine_config().async_scheduling
    # The automatic choice never asks for what the config cannot do (an explicit True does).
    assert not EngineArgs(model=tiny.target, device="cpu", tensor_parallel_size=2,
                          speculative_config=dict(spec, disable_by_batch_size="auto")
                          ).create_engine_config().async_scheduling
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        EngineArgs(model=tiny.target, device="cpu", async_scheduling=True,
                   tensor_parallel_size=2).create_engine_config()


def test_runner_token_history_matches_the_scheduler(tiny):
    # The runner appends a placeholder per launched sampling step and fills it on collection:
    # its history must equal the scheduler's tokens, plus at most the one in-flight placeholder.
    with make_engine(tiny, True) as engine:
        runner = engine.executor.worker.model_runner
        for i, (rid, p) in enumerate(PROMPTS.items()):
            engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=9,
                                                      ignore_eos=True))
        checked = 0
        while engine.has_unfinished_requests():
            engine.step()
            for rid, request in engine.scheduler.requests.items():
                if rid not in runner.requests:
                    continue
                history = runner.requests[rid].token_ids
                known = request.all_token_ids
                assert history[:len(known)] == known
                assert len(history) - len(known) == request.num_output_placeholders <= 1
                assert -1 not in history[:len(known)]
                checked += 1
        assert checked > 10
