"""The target step plans attention only for KV cache groups that hold target layers. A group of
drafter layers gets its slot mapping alone (`KVWriteOnlyMetadata`): block drafters write their
context KV there, and their attention runs in the draft step, which the speculator plans. Tiny
model, CPU, the real runner; the end-to-end exactness of drafting is covered by the spec-decode
exactness tests."""
from __future__ import annotations

import pytest

from tests.utils.runner_harness import Scenario, make_config, make_runner, run_scenario
from vllm.model_executor.models.tiny import write_tiny_models
from vllm.v1.worker.gpu.attn_utils import KVWriteOnlyMetadata


@pytest.fixture(scope="module")
def paths():
    return write_tiny_models()


@pytest.mark.parametrize("method,k", [("dspark", 4), ("eagle", 3)])
def test_drafter_groups_get_slot_mappings_and_no_plan_in_the_target_step(paths, method, k):
    runner = make_runner(make_config(paths.target, method, getattr(paths, method), k=k))
    groups = runner.kv_cache_config.kv_cache_groups
    draft_layers = runner._draft_layer_names()
    draft_only = [g for g, group in enumerate(groups)
                  if set(group.layer_names) <= draft_layers]
    assert list(runner._kv_write_only_groups) == draft_only
    if method == "dspark":
        assert draft_only, "DSpark's non-causal layers must have a group of their own"

    # Count builder calls per group and phase (target step vs draft step).
    calls: list[tuple[int, str]] = []
    phase = {"now": "target"}
    for g, builder in enumerate(runner.attn_metadata_builders):
        original = builder.build

        def counted(*args, _g=g, _original=original, **kwargs):
            calls.append((_g, phase["now"]))
            return _original(*args, **kwargs)
        builder.build = counted
    real_propose = runner.speculator.propose

    def propose(*args, **kwargs):
        phase["now"] = "draft"
        try:
            return real_propose(*args, **kwargs)
        finally:
            phase["now"] = "target"
    runner.speculator.propose = propose

    seen = []
    real_build_batch = runner._build_batch

    def build_batch(*args, **kwargs):
        batch = real_build_batch(*args, **kwargs)
        seen.append(batch)
        return batch
    runner._build_batch = build_batch

    prompts = {"a": [72, 101, 108, 108, 111, 32, 119], "b": [84, 104, 101, 32]}
    run_scenario(runner, Scenario("kv_write_only", prompts, max_new_tokens=6))

    for g in draft_only:
        assert (g, "target") not in calls  # no plan for the drafter's group in a target step
        if method == "dspark":
            assert (g, "draft") in calls  # the draft step plans it
    assert seen
    for batch in seen:
        for g in draft_only:
            for name in groups[g].layer_names:
                entry = batch.attn_metadata[name]
                assert isinstance(entry, KVWriteOnlyMetadata)
                assert entry.slot_mapping.data_ptr() == batch.slot_mappings[g].data_ptr()
                assert entry.slot_mapping.shape[0] == batch.num_tokens_padded
