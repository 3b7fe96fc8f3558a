"""The four speculators' propose paths: own seq_lens advance/roll back, DCP-local lengths
recomputed through the shared base (module-level prepare_dcp_local_seq_lens), step indices,
block layout, Markov left-to-right drafting, and DFlash owning no DCP code."""
from __future__ import annotations

import glob
import inspect
import os

import numpy as np
import pytest
import torch

from tests.utils.spec_fakes import (MASK_TOKEN, VOCAB, FakeBlockModel, FakeEagleModel, brute_local_len,
                        make_speculator)
from vllm.v1.worker.gpu.cp_utils import prepare_dcp_local_seq_lens
from vllm.v1.worker.gpu.spec_decode import block_speculator, speculator as speculator_module
from vllm.v1.worker.gpu.spec_decode.dflash import speculator as dflash_module
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator
from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator
from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator
from vllm.v1.worker.gpu.spec_decode.mtp.speculator import MTPSpeculator
from vllm.v1.worker.gpu.spec_decode.speculator import DraftInputs, Speculator

HIDDEN = 8


def make_inputs(num_computed_old, num_scheduled, num_accepted, anchors):
    """DraftInputs of a target step that verified (num_scheduled - 1) drafts per request."""
    num_computed_old = np.asarray(num_computed_old, dtype=np.int64)
    num_scheduled = np.asarray(num_scheduled, dtype=np.int64)
    num_computed_new = num_computed_old + 1 + np.asarray(num_accepted, dtype=np.int64)
    qsl = np.concatenate([[0], np.cumsum(num_scheduled)]).astype(np.int32)
    total = int(qsl[-1])
    positions = np.concatenate([np.arange(c, c + s) for c, s in zip(num_computed_old, num_scheduled)])
    return DraftInputs(
        num_reqs=len(num_scheduled),
        query_start_loc_np=qsl,
        target_input_ids=torch.arange(100, 100 + total) % VOCAB,
        target_positions=torch.from_numpy(positions),
        target_hidden_states=torch.randn(total, HIDDEN),
        target_seq_lens_cpu=torch.from_numpy((num_computed_old + num_scheduled).astype(np.int32)),
        num_computed_new=num_computed_new,
        last_accepted_index=torch.from_numpy(qsl[:-1] + (num_computed_new - num_computed_old) - 1)
        .to(torch.int64),
        next_token_ids=torch.tensor(anchors, dtype=torch.int64),
        aux_hidden_states=torch.randn(total, 2 * HIDDEN),
    )


@pytest.fixture
def recorded_prepare(monkeypatch):
    """Patch the module-level name the base calls; record args and the seq_lens values seen."""
    calls = []

    def recording(out, seq_lens, num_reqs, cp_size, cp_rank, cp_interleave):
        calls.append({"out": out, "seq_lens": seq_lens, "values": seq_lens[:num_reqs].tolist(),
                      "args": (num_reqs, cp_size, cp_rank, cp_interleave)})
        prepare_dcp_local_seq_lens(out, seq_lens, num_reqs, cp_size, cp_rank, cp_interleave)

    monkeypatch.setattr(speculator_module, "prepare_dcp_local_seq_lens", recording)
    return calls


def spy_steps(spec):
    steps = []
    original = spec._build_draft_attn_metadata

    def spy(*args, **kwargs):
        steps.append(kwargs.get("step"))
        return original(*args, **kwargs)

    spec._build_draft_attn_metadata = spy
    return steps


CP = dict(cp_size=2, cp_rank=1, interleave=4)


@pytest.mark.parametrize("cls", [EagleSpeculator, MTPSpeculator])
def test_autoregressive_paths_advance_own_seq_lens_and_recompute(cls, recorded_prepare):
    model = FakeEagleModel()
    spec, (builder,) = make_speculator(cls, k=3, num_reqs=3, model=model, **CP)
    steps = spy_steps(spec)
    # 3 requests verified 4 tokens each; accepted 3, 1, 0 drafts.
    inputs = make_inputs([4, 8, 12], [4, 4, 4], [3, 1, 0], anchors=[10, 20, 30])
    drafts, _ = spec.propose(inputs)

    assert steps == [0, 1, 2]
    new = inputs.num_computed_new  # [8, 10, 13]
    expected_lens = [[8, 12, 16], (new + 1).tolist(), (new + 2).tolist()]
    assert [c["values"] for c in recorded_prepare] == expected_lens
    for call in recorded_prepare:
        assert call["out"] is spec.input_buffers.dcp_local_seq_lens
        assert call["seq_lens"] is spec.input_buffers.seq_lens
        assert call["args"] == (3, 2, 1, 4)
    for snap, lens in zip(builder.calls, expected_lens):
        assert snap.seq_lens == lens
        assert snap.dcp_local_seq_lens == [brute_local_len(n, 2, 1, 4) for n in lens]
        assert snap.dcp_local_data_ptr == spec.input_buffers.dcp_local_seq_lens.data_ptr()
        assert snap.causal is True
    # Upper bound = target seq_len + step, always >= the draft's real length.
    assert [s.upper_bound.tolist() for s in builder.calls] == [[8, 12, 16], [9, 13, 17], [10, 14, 18]]

    # First pass: target ids shifted left by one, anchor on the last accepted row.
    first_ids, first_pos = model.calls[0]
    shifted = (torch.arange(101, 112) % VOCAB).tolist()
    expected_ids = shifted + [0]
    for row, anchor in zip(inputs.last_accepted_index.tolist(), [10, 20, 30]):
        expected_ids[row] = anchor
    assert first_ids[:11] == expected_ids[:11] and first_ids[3] == 10 and first_ids[8] == 30
    assert first_pos == inputs.target_positions.tolist()
    # Steps 1 and 2: one token per request at num_computed_new + step - 1.
    assert model.calls[1][1] == (new + 0).tolist() and model.calls[2][1] == (new + 1).tolist()
    assert drafts.tolist() == [[11, 12, 13], [21, 22, 23], [31, 32, 33]]


@pytest.mark.parametrize("cls,q_of_k", [(DFlashSpeculator, lambda k: k + 1),
                                        (DSparkSpeculator, lambda k: k)])
def test_block_paths_use_own_seq_lens_and_recompute(cls, q_of_k, recorded_prepare):
    k = 4
    model = FakeBlockModel()
    spec, (target_builder, draft_builder) = make_speculator(
        cls, k=k, num_reqs=2, model=model, group_non_causal=(False, True), draft_groups=(1,), **CP)
    steps = spy_steps(spec)
    inputs = make_inputs([8, 20], [5, 5], [1, 4], anchors=[5, 7])
    spec.propose(inputs)
    q = q_of_k(k)
    new = inputs.num_computed_new  # [10, 25]
    assert steps == [q]
    assert [c["values"] for c in recorded_prepare] == [(new + q).tolist()]
    assert recorded_prepare[0]["out"] is spec.input_buffers.dcp_local_seq_lens
    assert recorded_prepare[0]["seq_lens"] is spec.input_buffers.seq_lens
    assert recorded_prepare[0]["args"] == (2, 2, 1, 4)
    assert target_builder.calls == []  # the target's group is not rebuilt for the draft
    snap = draft_builder.calls[-1]
    assert snap.causal is False
    assert snap.query_start_loc == [0, q, 2 * q]
    assert snap.dcp_local_seq_lens == [brute_local_len(n, 2, 1, 4) for n in new + q]
    ids, positions = model.calls[-1]
    assert ids == [5] + [MASK_TOKEN] * (q - 1) + [7] + [MASK_TOKEN] * (q - 1)
    assert positions == list(range(10, 10 + q)) + list(range(25, 25 + q))


def test_dflash_drafts_come_from_mask_rows():
    model = FakeBlockModel()
    spec, _ = make_speculator(DFlashSpeculator, k=3, num_reqs=1, model=model,
                              group_non_causal=(False, True), draft_groups=(1,))
    drafts, _ = spec.propose(make_inputs([8], [4], [1], anchors=[5]))
    # Fake row logits favour (id + pos) % V; mask rows are at positions 11, 12, 13.
    assert drafts.tolist() == [[(MASK_TOKEN + p) % VOCAB for p in (11, 12, 13)]]


def test_dspark_markov_head_samples_left_to_right():
    model = FakeBlockModel()
    spec, _ = make_speculator(DSparkSpeculator, k=4, num_reqs=2, model=model,
                              group_non_causal=(False, True), draft_groups=(1,))
    drafts, _ = spec.propose(make_inputs([8, 3], [4, 1], [1, 0], anchors=[5, 40]))
    # The bias (10 * one-hot(prev + 1)) dominates the row logits: each draft follows the previous.
    assert drafts.tolist() == [[6, 7, 8, 9], [41, 42, 43, 44]]


def test_block_speculator_precomputes_context_from_tapped_layers():
    model = FakeBlockModel()
    spec, _ = make_speculator(DSparkSpeculator, k=4, num_reqs=1, model=model,
                              group_non_causal=(False, True), draft_groups=(1,))
    assert spec.aux_hidden_state_layers == (0, 1)
    spec.precompute_context(torch.zeros(3, 16), torch.tensor([4, 5, 6]))
    assert model.context_calls == [((3, 16), [4, 5, 6])]
    with pytest.raises(ValueError, match="hidden states"):
        spec.precompute_context(None, torch.tensor([4]))


# ------------------------------------------------------- DESIGN §6 worked example
@pytest.mark.parametrize("rank,eagle_local,dspark_local", [(0, 7, 8), (1, 4, 6)])
def test_design_worked_example(rank, eagle_local, dspark_local, recorded_prepare):
    """N=2, I=4: target verified positions 8..11 (G=12, target-local r0 = 8), 2 of 3 drafts
    rejected -> accepted prefix 10. EAGLE step 1: seq_len 11 -> r0 7 (stale 8 would read a
    rejected token's KV). DSpark Q=4: seq_len 9+1+4 = 14 -> r0 8, r1 6."""
    cp = dict(cp_size=2, cp_rank=rank, interleave=4)
    eagle, (builder,) = make_speculator(EagleSpeculator, k=2, num_reqs=1,
                                        model=FakeEagleModel(), **cp)
    inputs = make_inputs([8], [4], [1], anchors=[9])
    assert inputs.num_computed_new.tolist() == [10]
    eagle.propose(inputs)
    first, step1 = builder.calls
    assert first.seq_lens == [12] and first.dcp_local_seq_lens == [[8], [4]][rank]
    assert step1.seq_lens == [11] and step1.dcp_local_seq_lens == [eagle_local]

    dspark, (_, draft_builder) = make_speculator(
        DSparkSpeculator, k=4, num_reqs=1, model=FakeBlockModel(),
        group_non_causal=(False, True), draft_groups=(1,), **cp)
    dspark.propose(inputs)
    assert draft_builder.calls[-1].seq_lens == [14]
    assert draft_builder.calls[-1].dcp_local_seq_lens == [dspark_local]


# ------------------------------------------------------- DFlash owns no DCP code
DCP_NAMES = ("cp_size", "cp_rank", "cp_interleave", "prepare_dcp_local_seq_lens",
             "get_dcp_local_seq_lens", "dcp_local")


def _dflash_sources():
    package_dir = os.path.dirname(dflash_module.__file__)
    files = sorted(glob.glob(os.path.join(package_dir, "*.py")))
    return files + [inspect.getsourcefile(block_speculator)]


@pytest.mark.parametrize("path", _dflash_sources(), ids=os.path.basename)
def test_dflash_source_has_no_dcp_logic(path):
    """Every file of the dflash package, and the block machinery it reuses, is free of DCP."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    for name in DCP_NAMES:
        assert name not in source, f"{path} mentions {name}: DCP belongs to the shared base"


def test_dflash_inherits_the_shared_builder():
    for cls in DFlashSpeculator.__mro__:
        if cls is Speculator:
            break
        assert "_build_draft_attn_metadata" not in vars(cls), cls
    assert DFlashSpeculator._build_draft_attn_metadata is Speculator._build_draft_attn_metadata


def test_dflash_goes_through_patched_base_prepare(recorded_prepare):
    spec, (_, draft_builder) = make_speculator(
        DFlashSpeculator, k=3, num_reqs=1, model=FakeBlockModel(),
        group_non_causal=(False, True), draft_groups=(1,), cp_size=2, cp_rank=0, interleave=4)
    spec.propose(make_inputs([8], [4], [1], anchors=[9]))
    # seq_len = 10 + Q(4) = 14 -> rank 0 local 8; the base recomputed it from the draft's lengths.
    assert [c["values"] for c in recorded_prepare] == [[14]]
    assert recorded_prepare[0]["seq_lens"] is spec.input_buffers.seq_lens
    assert draft_builder.calls[-1].dcp_local_seq_lens == [8]


def test_probabilistic_block_drafts_sample_q_left_to_right():
    from types import SimpleNamespace

    from vllm.v1.sample.metadata import SamplingMetadata, make_generator

    def run(seed):
        model = FakeBlockModel()
        spec, _ = make_speculator(DSparkSpeculator, k=4, num_reqs=2, model=model,
                                  group_non_causal=(False, True), draft_groups=(1,))
        spec.draft_sample_method = "probabilistic"
        inputs = make_inputs([8, 3], [4, 1], [1, 0], anchors=[5, 40])
        # Row 0 samples at T=4 (flat enough to leave the argmax), row 1 is greedy.
        inputs.sampling_metadata = SamplingMetadata.from_sampling_params(
            [SimpleNamespace(temperature=4.0, top_k=0, top_p=1.0), None], "cpu",
            {0: make_generator(seed, "cpu")})
        inputs.slots = torch.tensor([5, 2])  # rows live in request slots 5 and 2
        drafts, buffer = spec.propose(inputs)
        assert buffer is spec.draft_probs_buffer and buffer.shape == (8, 4, VOCAB)
        return drafts, buffer[torch.tensor([5, 2])]

    drafts, probs = run(seed=3)
    assert probs.shape == (2, 4, VOCAB)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 4))
    # Greedy row: argmax chain with one-hot q.
    assert drafts[1].tolist() == [41, 42, 43, 44]
    assert probs[1].max(-1).values.tolist() == [1.0] * 4
    # Sampled row: every draft has positive q, and q_j is conditioned on draft j-1 (Markov bias).
    for j in range(4):
        assert probs[0, j, drafts[0, j]] > 0
        previous = 5 if j == 0 else int(drafts[0, j - 1])
        assert int(probs[0, j].argmax()) == (previous + 1) % VOCAB
    assert torch.equal(run(seed=3)[0], drafts)  # the request's generator makes it reproducible


@pytest.mark.parametrize("cls,q_of_k", [(DFlashSpeculator, lambda k: k + 1),
                                        (DSparkSpeculator, lambda k: k)])
def test_block_inputs_stay_exact_across_steps_and_padding(cls, q_of_k):
    # The block's mask columns are written once and only the anchor column each step: over a
    # sequence of steps with shrinking / growing batches and CUDA-graph-style padding rows, the
    # block ids, positions and draft seq_lens must equal the brute-force block every time.
    k = 4
    q = q_of_k(k)
    spec, _ = make_speculator(cls, k=k, num_reqs=4, model=FakeBlockModel(),
                              group_non_causal=(False, True), draft_groups=(1,))
    buffers = spec.input_buffers
    for num_reqs, padded, accepted, anchors in [(2, 2, [10, 25], [5, 7]), (4, 4, [3, 4, 5, 6], [1, 2, 3, 4]),
                                                (1, 2, [40], [9]), (3, 4, [7, 8, 9], [6, 5, 4]),
                                                (2, 2, [11, 1], [8, 3])]:
        acc = torch.tensor(accepted, dtype=torch.int64)
        buffers.positions.fill_(-5)  # stale values where the block must write
        spec._write_block(num_reqs, padded, acc, torch.tensor(anchors, dtype=torch.int64))
        ids = buffers.input_ids[: padded * q].view(padded, q).tolist()
        positions = buffers.positions[: padded * q].view(padded, q).tolist()
        want_anchor = anchors + [0] * (padded - num_reqs)
        assert ids == [[a] + [MASK_TOKEN] * (q - 1) for a in want_anchor]
        assert positions == ([list(range(n, n + q)) for n in accepted]
                             + [[0] * q] * (padded - num_reqs))
        assert buffers.seq_lens[:num_reqs].tolist() == [n + q for n in accepted]
