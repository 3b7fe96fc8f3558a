"""The block drafters' fused input write (spec_decode/block_inputs.py): the torch twin against a
brute-force oracle on random geometries (DCP 1/2/4, interleave 1/2/4, replicated groups, a subset
of groups drafted, CUDA-graph padding rows, clamping at max_model_len); the Triton kernel against
the same oracle under the Triton interpreter; and the speculator's builder using those slots."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.utils.block_inputs_cases import (expected_lowering, expected_writes,
                                            observed_writes, random_case, random_lowering,
                                            run_write, untouched_tails)
from tests.utils.spec_fakes import FakeBlockModel, make_speculator
from tests.utils.triton_interpreter import run_interpreter_driver
from vllm.v1.worker.gpu.spec_decode import block_inputs
from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator


@pytest.mark.parametrize("seed", range(60))
def test_torch_twin_equals_brute_force(seed):
    case = random_case(seed)
    run_write(case, block_inputs.write_block_inputs_torch)
    assert observed_writes(case) == expected_writes(case)
    assert untouched_tails(case)


@pytest.mark.parametrize("seed", range(30))
def test_a_fused_plan_lowering_writes_the_new_lengths_into_the_plan(seed):
    """write_block_inputs with a held plan's lowering (plan_lowering.PlanLowering): the inputs
    as without one, and every listed work position and the first num_reqs of kv_len_arr hold
    their request's new seq_len (brute force), nothing else of the workspace is written."""
    case = random_case(seed)
    lowering = random_lowering(case, seed)
    run_write(case, block_inputs.write_block_inputs, lowering)
    assert observed_writes(case) == expected_writes(case)
    assert (lowering.ws.tolist(), lowering.kv_len_arr.tolist()) == expected_lowering(case,
                                                                                     lowering)
    with pytest.raises(ValueError, match="plan lowering is for"):
        lowering.num_reqs += 1
        run_write(case, block_inputs.write_block_inputs, lowering)


def test_cases_cover_the_geometries():
    """The random cases reach what the oracle is meant to check (else the test above proves
    less than it says)."""
    cases = [random_case(seed) for seed in range(60)]
    assert {c["tables"].cp_size for c in cases} == {1, 2, 4}
    assert {c["tables"].cp_interleave for c in cases} == {1, 2, 4}
    assert any(c["padded"] > c["num_reqs"] for c in cases)
    assert any(c["num_reqs"] == 0 for c in cases)
    assert any(not all(c["sharded"]) and c["tables"].cp_size > 1 for c in cases)
    assert any(len(c["buffers"].group_ids_host) < c["tables"].num_kv_cache_groups for c in cases)
    assert any(a + c["start_offset"] + c["q"] > c["max_model_len"]
               for c in cases for a in c["accepted"].tolist())
    assert any(c["start_offset"] > 0 and c["num_reqs"] > 0 for c in cases)
    assert any(c["next_token_ids"].stride(0) > 1 and c["num_reqs"] > 1 for c in cases)
    # the early draft step's indirections, alone and together, on rows that exist
    assert any(c["accepted_extra"] is not None and c["next_token_rows"] is None
               and c["num_reqs"] > 1 for c in cases)
    assert any(c["next_token_rows"] is not None and c["accepted_extra"] is None
               and c["num_reqs"] > 1 for c in cases)
    assert any(c["accepted_extra"] is not None and c["next_token_rows"] is not None
               and c["num_reqs"] > 1 for c in cases)


def test_dispatcher_returns_the_slot_view_and_checks_sizes():
    case = random_case(3)
    slots = block_inputs.write_block_inputs(case["tables"], case["buffers"], case["num_reqs"],
                                            case["padded"], case["q"], case["accepted"],
                                            case["next_token_ids"], case["max_model_len"],
                                            case["start_offset"])
    assert slots.data_ptr() == case["tables"].slot_mappings.data_ptr()
    assert slots.shape == (case["tables"].num_kv_cache_groups, case["padded"] * case["q"])
    with pytest.raises(ValueError, match="num_reqs"):
        block_inputs.write_block_inputs(case["tables"], case["buffers"], case["padded"] + 1,
                                        case["padded"], case["q"], case["accepted"],
                                        case["next_token_ids"], case["max_model_len"])


@pytest.mark.slow
def test_triton_kernel_equals_brute_force_under_interpreter():
    run_interpreter_driver(Path(__file__).parents[2].joinpath("utils", "triton_block_inputs_interpret_driver.py"))


@pytest.mark.parametrize("cp_size,cp_rank,interleave", [(1, 0, 1), (2, 1, 4), (4, 3, 1)])
def test_block_propose_slots_equal_the_generic_slot_mapping(cp_size, cp_rank, interleave):
    """The slots the fused write hands the draft builder are those compute_slot_mappings gives
    for the same block (the path every other forward uses), in the drafter's group; padding rows
    PAD. Also: the builder is handed them and does not recompute."""
    spec, (_, draft_builder) = make_speculator(
        DSparkSpeculator, k=4, num_reqs=3, model=FakeBlockModel(), group_non_causal=(False, True),
        draft_groups=(1,), cp_size=cp_size, cp_rank=cp_rank, interleave=interleave)
    tables = spec.block_tables
    accepted = torch.tensor([10, 37, 3], dtype=torch.int64)
    _, slots = spec._write_block(3, 4, accepted, torch.tensor([5, 6, 7]))
    fused = slots[1, :16].clone()
    buffers = spec.input_buffers
    qsl = torch.tensor([0, 4, 8, 12, 12], dtype=torch.int32)
    reference = tables.compute_slot_mappings(qsl, buffers.positions[:16])[1].clone()
    assert fused.tolist() == reference.tolist()
    assert fused[12:].tolist() == [-1] * 4

    calls = []
    original = tables.compute_slot_mappings
    tables.compute_slot_mappings = lambda *a, **k: calls.append(a) or original(*a, **k)
    spec._build_draft_attn_metadata(3, 4, 16, np.array([14, 41, 7]), step=4,
                                    num_query_per_req=4, causal=False, slot_mappings=slots,
                                    padding_written=True)
    assert calls == []
    common = draft_builder.calls[-1].common
    assert common.slot_mapping.data_ptr() == tables.slot_mappings[1].data_ptr()


@pytest.mark.parametrize("cp_size,cp_rank,interleave", [(1, 0, 1), (2, 1, 1), (4, 2, 4)])
def test_eagle_steps_hand_the_builder_the_generic_slots(cp_size, cp_rank, interleave):
    """EAGLE/MTP steps 1..k-1 use the fused write as rows of one token: the slots the builder
    gets (and the draft's positions / seq_lens) equal the generic slot mapping of positions
    num_computed_new + step - 1 and lengths num_computed_new + step."""
    from tests.utils.spec_fakes import FakeEagleModel
    from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftInputs
    spec, _ = make_speculator(EagleSpeculator, k=4, num_reqs=3, model=FakeEagleModel(),
                              cp_size=cp_size, cp_rank=cp_rank, interleave=interleave)
    tables, buffers = spec.block_tables, spec.input_buffers
    computed = np.array([17, 40, 63], dtype=np.int64)  # accepted prefix after this step
    seen = []
    original = spec._build_draft_attn_metadata

    def spy(*args, **kwargs):
        if kwargs.get("slot_mappings") is not None:
            seen.append((kwargs["step"], buffers.positions[:3].tolist(),
                         buffers.seq_lens[:3].tolist(), kwargs["slot_mappings"][0, :3].tolist()))
        return original(*args, **kwargs)

    spec._build_draft_attn_metadata = spy
    spec.propose(DraftInputs(
        num_reqs=3, query_start_loc_np=np.arange(4), target_input_ids=torch.tensor([1, 2, 3]),
        target_positions=torch.from_numpy(computed - 1), target_hidden_states=torch.zeros(3, 8),
        target_seq_lens_cpu=torch.from_numpy(computed.astype(np.int32)),
        num_computed_new=computed, last_accepted_index=torch.arange(3),
        next_token_ids=torch.tensor([4, 5, 6])))
    assert [s[0] for s in seen] == [1, 2, 3]
    qsl = torch.arange(4, dtype=torch.int32)
    for step, positions, seq_lens, slots in seen:
        assert positions == (computed + step - 1).tolist()
        assert seq_lens == (computed + step).tolist()
        reference = tables.compute_slot_mappings(qsl, torch.tensor(positions))[0]
        assert slots == reference.tolist()


@pytest.mark.gpu
def test_triton_kernel_equals_brute_force_on_cuda():
    """The compiled kernel on the GPU (not the interpreter) against the oracle and the twin."""
    for seed in range(40):
        case, twin = random_case(seed, "cuda"), random_case(seed, "cuda")
        run_write(case, block_inputs.write_block_inputs_triton)
        run_write(twin, block_inputs.write_block_inputs_torch)
        torch.cuda.synchronize()
        assert observed_writes(case) == expected_writes(case), seed
        assert observed_writes(case) == observed_writes(twin), seed
        assert untouched_tails(case), seed
        case = random_case(seed, "cuda")
        lowering = random_lowering(case, seed)
        run_write(case, block_inputs.write_block_inputs_triton, lowering)
        torch.cuda.synchronize()
        assert observed_writes(case) == expected_writes(case), seed
        assert (lowering.ws.tolist(), lowering.kv_len_arr.tolist()) == expected_lowering(
            case, lowering), seed


def test_the_kernel_launches_lean_by_default():
    """block_inputs.py launches its kernel through LeanLaunch, on unless
    VLLM_LEAN_TRITON_LAUNCH=0 (the step-preparation kernel stays off unless =1)."""
    from vllm.utils.triton_launch import lean_launch_enabled
    launch = block_inputs._BLOCK_INPUTS_LAUNCH
    if launch is None:
        pytest.skip("Triton is not installed")
    assert launch.enabled is lean_launch_enabled(default=True)


@pytest.mark.gpu
def test_lean_launches_equal_brute_force_on_cuda(monkeypatch):
    """A write whose arguments match the one before (other buffers of the same dtypes, device
    and alignment, the same specialized values) skips Triton's binding and calls the compiled
    launcher directly (the default for this kernel). Those writes equal the oracle too."""
    launch = block_inputs._BLOCK_INPUTS_LAUNCH
    monkeypatch.setattr(launch, "enabled", True)
    leaned = 0
    for seed in range(40):
        run_write(random_case(seed, "cuda"), block_inputs.write_block_inputs_triton)  # learns
        case = random_case(seed, "cuda")
        before = launch.lean_launches
        run_write(case, block_inputs.write_block_inputs_triton)
        torch.cuda.synchronize()
        leaned += launch.lean_launches - before
        assert observed_writes(case) == expected_writes(case), seed
        assert untouched_tails(case), seed
    assert leaned >= 30  # seeds with no rows (an empty grid) may stay on Triton
