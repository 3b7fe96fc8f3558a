"""A speculative engine's policy switches one KV cache group between plain Q=1 steps (planned
causal=False: one row sees everything) and verify Q=1+k steps (planned causal=True at DCP 1),
in CUDA-graph mode and eagerly. Each FlashInfer wrapper must keep one causal flag, so that every
plan after a wrapper's first is a native re-plan: a shared wrapper made every switch a full
plan() (~1 ms of host time and pinned allocations on an H200), twice per policy probe step.
CPU, with a stand-in wrapper that models FlashInfer's re-plan condition."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from tests.utils.fake_flashinfer import install_native_replan
from tests.utils.mla_dcp_helpers import build_rank, make_case, mla_spec, parallel_config

# A policy's step sequence: the capture (verify shape first), plain stretches, probes.
Q_SEQUENCE = [5, 5, 1, 1, 1, 5, 1, 1, 5, 5, 1, 1]


@pytest.mark.parametrize("cudagraph", [True, False])
def test_alternating_q1_and_verify_steps_make_one_full_plan_per_wrapper(monkeypatch, cudagraph):
    install_native_replan(monkeypatch)
    from vllm.v1.attention.backends.mla import flashinfer_mla as fm
    config = SimpleNamespace(parallel_config=parallel_config(1, 1).parallel_config,
                             model_config=SimpleNamespace(max_model_len=512), max_num_seqs=4)
    builder = fm.FlashInferMLAMetadataBuilder(mla_spec(16, False, torch.float32), ["layer.0"],
                                              config, "cpu", dcp_rank=0, kernel_family="hopper")
    builder.reorder_batch_threshold = max(Q_SEQUENCE)
    impl = fm.FlashInferMLAImpl(num_heads=4, scale=0.1)
    for step, q in enumerate(Q_SEQUENCE):
        case = make_case([40 + step, 70 + 3 * step], [q, q], num_heads=4, causal=True, seed=step,
                         dtype=torch.float32)
        _, cache, cm, _ = build_rank(case, fm.FlashInferMLAMetadataBuilder, 1, 0, 1, 16,
                                     fill=0.0, builder_kwargs=dict(kernel_family="hopper"))
        md = builder.build(0, replace(cm, cudagraph=cudagraph))
        impl.forward_decode(case.q, cache, md.decode)
    slots = list((builder._graph_slots if cudagraph else builder._slots).values())
    assert len(slots) == 2  # one wrapper for Q=1 steps, one for verify steps
    for slot in slots:
        assert len(set(slot.wrapper.plan_causal_flags)) == 1
        assert slot.full_plans == 1, (slot.full_plans, slot.native_replans)
    assert sum(s.full_plans + s.native_replans for s in slots) == len(Q_SEQUENCE)


def test_only_the_draft_block_graph_wrapper_takes_the_draft_slack(monkeypatch):
    """A block drafter's non-causal draft-block wrapper is marked for the draft slack (no output
    depends on its split: flashinfer_plan_refresh.refresh_slack); a target group's Q=1 and
    verify wrappers are not, so a speculative engine's plain steps split the KV as a plain
    engine's do. (What the mark does to refreshes: test_flashinfer_plan_refresh.py.)"""
    install_native_replan(monkeypatch)
    from vllm.v1.attention.backends.mla import flashinfer_mla as fm
    config = SimpleNamespace(parallel_config=parallel_config(1, 1).parallel_config,
                             model_config=SimpleNamespace(max_model_len=2048), max_num_seqs=4)
    for non_causal, q in ((False, 1), (False, 5), (True, 5)):
        builder = fm.FlashInferMLAMetadataBuilder(
            mla_spec(16, non_causal, torch.float32), ["layer.0"], config, "cpu", dcp_rank=0,
            kernel_family="hopper")
        builder.reorder_batch_threshold = 5
        case = make_case([700, 900], [q, q], num_heads=4, causal=not non_causal,
                         dtype=torch.float32)
        _, cache, cm, _ = build_rank(case, fm.FlashInferMLAMetadataBuilder, 1, 0, 1, 16,
                                     fill=0.0, builder_kwargs=dict(kernel_family="hopper"))
        md = builder.build(0, replace(cm, cudagraph=True))
        fm.FlashInferMLAImpl(num_heads=4, scale=0.1).forward_decode(case.q, cache, md.decode)
        (slot,) = builder._graph_slots.values()
        assert slot.draft == non_causal, (non_causal, q)
