"""GPUModelRunner on the tiny model (CPU): KV cache groups per drafter, batch layout, start-up
capability checks and clear errors for inconsistent scheduler output."""
from __future__ import annotations


import pytest
import torch

from tests.utils.runner_harness import Scenario, greedy_oracle, make_config, make_runner, run_scenario  # noqa: E402
from vllm.model_executor.models.tiny import write_tiny_models  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_kv_cache_config  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.worker.gpu.model_runner import GPUModelRunner  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_models()  # shared cache, written once per machine


def _runner(tiny, method=None, k=3, **kwargs):
    return make_runner(make_config(tiny.target, method, getattr(tiny, method) if method else None,
                                   k=k, **kwargs))


@pytest.mark.parametrize("method,num_groups", [(None, 1), ("eagle", 1), ("mtp", 1),
                                               ("dflash", 2), ("dspark", 2)])
def test_kv_cache_groups_keep_non_causal_draft_layers_apart(tiny, method, num_groups):
    runner = _runner(tiny, method)
    groups = runner.kv_cache_config.kv_cache_groups
    assert len(groups) == num_groups
    assert groups[0].kv_cache_spec.non_causal_multi_token_decode is False
    if num_groups == 2:
        assert groups[1].kv_cache_spec.non_causal_multi_token_decode is True
        assert all(name.startswith("draft_model.") for name in groups[1].layer_names)
        assert runner.speculator.group_ids == (1,)
    elif method is not None:
        assert runner.speculator.group_ids == (0,)
    # One [num_blocks, block_size, 576] tensor per layer, bound to the layer.
    for name, layer in runner._attention_layers().items():
        assert layer.kv_cache is runner.kv_caches[name]
        assert tuple(layer.kv_cache.shape) == (runner.kv_cache_config.num_blocks, 16, 576)
    assert len({t.data_ptr() for t in runner.kv_caches.values()}) == len(runner.kv_caches)


def test_decode_rows_first_and_logits_rows(tiny):
    runner = _runner(tiny, "eagle", k=2)
    first = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("x", [1, 2, 3, 4, 5], [0], 0)],
        scheduled_cached_reqs=CachedRequestData(), num_scheduled_tokens={"x": 5},
        total_num_scheduled_tokens=5)
    out = runner.execute_model(first)
    assert out.req_ids == ["x"] and len(out.sampled_token_ids[0]) == 1
    assert len(out.spec_token_ids[0]) == 2
    # Next step: "y" arrives (prefill) while "x" verifies its 2 drafts; "y" is listed first.
    second = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("y", [7, 8, 9], [1], 0)],
        scheduled_cached_reqs=CachedRequestData(["x"], [[]], [5]),
        num_scheduled_tokens={"y": 3, "x": 3}, total_num_scheduled_tokens=6,
        scheduled_spec_decode_tokens={"x": out.spec_token_ids[0]})
    runner._update_states(second)
    batch = runner._prepare_inputs(second)
    assert batch.req_ids == ["x", "y"]
    assert batch.query_start_loc_np.tolist() == [0, 3, 6]
    # x verifies all 3 of its rows; y samples from its last prompt token only.
    assert batch.logits_indices.tolist() == [0, 1, 2, 5]
    assert runner.input_buffers.positions[:6].tolist() == [5, 6, 7, 0, 1, 2]
    assert runner.input_buffers.seq_lens[:2].tolist() == [8, 3]


def test_inconsistent_scheduler_output_raises(tiny):
    runner = _runner(tiny, "dspark", k=2)
    runner.execute_model(SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("x", [1, 2, 3], [0], 0)],
        scheduled_cached_reqs=CachedRequestData(), num_scheduled_tokens={"x": 3},
        total_num_scheduled_tokens=3))
    bad_count = SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(["x"], [[]], [3]),
        num_scheduled_tokens={"x": 4}, total_num_scheduled_tokens=4,
        scheduled_spec_decode_tokens={"x": [5, 6]})
    with pytest.raises(ValueError, match="1 \\+ len\\(drafts\\)"):
        runner.execute_model(bad_count)
    stale_computed = SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(["x"], [[]], [2]),
        num_scheduled_tokens={"x": 1}, total_num_scheduled_tokens=1)
    with pytest.raises(ValueError, match="computed"):
        runner.execute_model(stale_computed)


def test_probabilistic_drafts_feed_their_q_to_rejection_sampling(tiny):
    """draft_sample_method=probabilistic with probabilistic rejection: greedy requests stay exact
    (their q is one-hot), the seeded random request reproduces, and verification receives the
    q rows of exactly the drafts it checks."""
    from vllm.sampling_params import SamplingParams

    def run_once():
        config = make_config(tiny.target, "dspark", tiny.dspark, k=3)
        config.speculative_config.draft_sample_method = "probabilistic"
        config.speculative_config.rejection_sample_method = "probabilistic"
        runner = make_runner(config)
        seen = []
        verify = runner.rejection_sampler.verify

        def recording(logits, drafts, num_drafts, metadata, draft_probs=None, **kw):
            seen.append((int(num_drafts.sum()), draft_probs, drafts.tolist()))
            return verify(logits, drafts, num_drafts, metadata, draft_probs, **kw)

        runner.rejection_sampler.verify = recording
        prompts = {"g": [3, 1, 4, 1, 5, 9], "r": [2, 7, 1, 8]}
        scenario = Scenario("prob", prompts, 8, sampling_params={
            "r": SamplingParams(temperature=1.0, seed=11, max_tokens=8)})
        return runner, run_scenario(runner, scenario), seen

    runner, first, seen = run_once()
    oracle = greedy_oracle(runner.model, {"g": [3, 1, 4, 1, 5, 9]}, 8)
    assert first.outputs["g"] == oracle["g"]
    _, second, _ = run_once()
    assert second.outputs["r"] == first.outputs["r"]
    verified = [(n, probs, drafts) for n, probs, drafts in seen if n > 0]
    assert verified
    for n, probs, drafts in verified:
        assert probs.shape == (n, 260)
        torch.testing.assert_close(probs.sum(-1), torch.ones(n))
        assert bool((probs[torch.arange(n), torch.tensor(drafts)] > 0).all())


def test_dspark_dcp_start_up_rejects_incapable_builder(tiny, monkeypatch):
    """A draft group whose builder cannot run non-causal blocks under DCP is refused at start-up
    (the check runs before any step), naming the builder."""
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.mla.torch_mla import TorchMLABackend, TorchMLAMetadataBuilder

    class NoDcpBlocksBuilder(TorchMLAMetadataBuilder):
        supports_non_causal_multi_token_dcp = False

    class Backend(TorchMLABackend):
        @staticmethod
        def get_builder_cls():
            return NoDcpBlocksBuilder

    monkeypatch.setattr(selector, "get_attn_backend", lambda *a, **k: Backend)
    monkeypatch.setattr("vllm.distributed.parallel_state.get_dcp_group",
                        lambda: type("G", (), {"rank_in_group": 0, "world_size": 2})())
    config = make_config(tiny.target, "dspark", tiny.dspark, k=2, dcp=2)
    runner = GPUModelRunner(config, torch.device("cpu"), 0)
    runner.model = _runner(tiny).model
    from vllm.model_executor.model_loader import get_draft_model
    runner.draft_model = get_draft_model(config, runner.model)
    with pytest.raises(ValueError, match="NoDcpBlocksBuilder"):
        runner.initialize_kv_cache(get_kv_cache_config(runner.get_kv_cache_spec(), num_blocks=8))


def test_preempted_request_is_recomputed_exactly(tiny):
    """A request preempted mid-decode comes back as a new request whose prompt holds its output so
    far; the rest of its greedy continuation is unchanged."""
    runner = _runner(tiny, "dflash", k=2)
    prompt = [10, 20, 30, 40, 50, 60]
    oracle = greedy_oracle(runner.model, {"p": prompt}, 6)["p"]
    out = runner.execute_model(SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("p", prompt, [0], 0)],
        scheduled_cached_reqs=CachedRequestData(), num_scheduled_tokens={"p": 6},
        total_num_scheduled_tokens=6))
    generated = out.sampled_token_ids[0]
    out = runner.execute_model(SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(["p"], [[]], [6]),
        num_scheduled_tokens={"p": 3}, total_num_scheduled_tokens=3,
        scheduled_spec_decode_tokens={"p": out.spec_token_ids[0]}))
    generated += out.sampled_token_ids[0]
    # Preempt, then re-admit with prompt + output into different blocks.
    resumed = Scenario("resume", {"p": prompt + generated}, 6 - len(generated))
    runner.execute_model(SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={}, total_num_scheduled_tokens=0, preempted_req_ids={"p"}))
    assert "p" not in runner.requests
    result = run_scenario(runner, resumed)
    assert generated + result.outputs["p"] == oracle
