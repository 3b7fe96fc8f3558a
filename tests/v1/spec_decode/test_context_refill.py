"""Draft context refilled before draft passes instead of written in plain steps
(VLLM_DRAFT_CONTEXT_REFILL=1, context_refill.py): the tracker and the refill's chunking against
brute force, and engines whose drafting switches off and on (tests/utils/context_kv_runs.py):
their greedy tokens and every draft pass equal the engine that writes context in every step,
the refill writes no target KV, and without it the drafts change."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.utils.context_kv_runs import run_switching_engine
from tests.utils.runner_harness import (Scenario, greedy_oracle, make_config, make_runner,
                                        run_all_methods)
from vllm.model_executor.models.tiny import write_tiny_models
from vllm.v1.worker.gpu.request_states import RequestState
from vllm.v1.worker.gpu.spec_decode.context_refill import (ENV_FLAG, ContextRefillTracker,
                                                          RefillPiece, chunk_pieces,
                                                          refill_enabled)


def _state(slot: int, num_computed: int) -> RequestState:
    return RequestState(f"r{slot}", slot, [0] * (num_computed + 1), num_computed)


def test_tracker_keeps_each_slots_first_skipped_position():
    tracker = ContextRefillTracker(4)
    states = [_state(s, 10 + s) for s in range(4)]
    assert not tracker.any_stale and tracker.stale_pieces(states) == []
    tracker.note_skipped(np.array([1, 3]), np.array([11, 13]))
    tracker.note_skipped(np.array([3, 1]), np.array([14, 12]))  # later steps: no change
    assert tracker.any_stale
    for state in states:
        state.num_computed_tokens += 2
    pieces = tracker.stale_pieces(states)
    assert [(p.state.slot, p.start, p.end) for p in pieces] == [(1, 11, 13), (3, 13, 15)]
    tracker.refilled(pieces[:1])
    assert tracker.any_stale  # slot 3 is still stale
    tracker.forget(3)  # its request left
    assert not tracker.any_stale or tracker.stale_pieces(states) == []
    tracker.refilled([])
    assert not tracker.any_stale


def test_refill_flag_refuses_other_values(monkeypatch):
    monkeypatch.setenv(ENV_FLAG, "yes")
    with pytest.raises(ValueError, match=f"{ENV_FLAG}='yes' is invalid"):
        refill_enabled()
    monkeypatch.setenv(ENV_FLAG, "1")
    assert refill_enabled()
    monkeypatch.delenv(ENV_FLAG)
    assert not refill_enabled()  # opt-in


@pytest.mark.parametrize("seed", range(40))
def test_chunking_covers_every_stale_position_once_within_the_limits(seed):
    rng = random.Random(seed)
    pieces = []
    for slot in rng.sample(range(64), rng.randint(1, 12)):
        start = rng.randint(0, 300)
        pieces.append(RefillPiece(_state(slot, start + 1), start, start + rng.randint(1, 200)))
    max_tokens, max_rows = rng.randint(1, 400), rng.randint(1, 6)
    passes = chunk_pieces(pieces, max_tokens, max_rows)
    seen: dict[int, list[tuple[int, int]]] = {}
    for chunk in passes:
        assert chunk and sum(p.num_tokens for p in chunk) <= max_tokens and len(chunk) <= max_rows
        slots = [p.state.slot for p in chunk]
        assert len(set(slots)) == len(slots)  # a request is one row of a pass
        assert [p.num_tokens for p in chunk] == sorted(p.num_tokens for p in chunk)
        for p in chunk:
            assert p.num_tokens >= 1
            seen.setdefault(p.state.slot, []).append((p.start, p.end))
    # Brute force: each request's positions, in pass order, are its stale range exactly once
    # and in order (a later piece reads the earlier positions' target KV from the cache).
    for piece in pieces:
        covered = [pos for start, end in seen.pop(piece.state.slot) for pos in range(start, end)]
        assert covered == list(range(piece.start, piece.end))
    assert not seen
    # full passes: only the last pass may have room left for another token and row
    for chunk in passes[:-1]:
        assert sum(p.num_tokens for p in chunk) == max_tokens or len(chunk) == max_rows
    with pytest.raises(ValueError, match="max_tokens=0"):
        chunk_pieces(pieces, 0, 1)


def _record_refill_builds(monkeypatch) -> list:
    """(num_decodes, num_prefills, max decode query length) of every MLA build made inside a
    refill pass."""
    import vllm.v1.worker.gpu.model_runner as model_runner
    from vllm.v1.attention.backends.mla.common import MLACommonMetadataBuilder

    builds, inside = [], []
    refill_pieces = model_runner.GPUModelRunner._refill_pieces
    build = MLACommonMetadataBuilder.build

    def marked(runner, pieces):
        inside.append(True)
        try:
            refill_pieces(runner, pieces)
        finally:
            inside.pop()

    def recorded(builder, common_prefix_len, common_attn_metadata):
        metadata = build(builder, common_prefix_len, common_attn_metadata)
        if inside and builder.non_causal_group is False:
            q = metadata.decode.max_query_len if metadata.decode is not None else 0
            builds.append((metadata.num_decodes, metadata.num_prefills, q))
        return metadata
    monkeypatch.setattr(model_runner.GPUModelRunner, "_refill_pieces", marked)
    monkeypatch.setattr(MLACommonMetadataBuilder, "build", recorded)
    return builds


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dspark", "dflash"])
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("through_decode", [True, False], ids=["decode_path", "prefill_path"])
def test_refilled_context_gives_the_drafts_of_the_written_context(monkeypatch, async_scheduling,
                                                                 method, through_decode):
    """Refill passes as decode rows of any length (the default) and as prefill rows with
    context (GPUModelRunner.refill_through_decode off) both give the written context's drafts;
    the builds inside refill passes show which path each took."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    common = dict(method=method, async_scheduling=async_scheduling)
    direct = run_switching_engine(monkeypatch, False, **common)
    monkeypatch.setattr(GPUModelRunner, "refill_through_decode", through_decode)
    builds = _record_refill_builds(monkeypatch)
    refilled = run_switching_engine(monkeypatch, False, refill=True, **common)
    assert builds
    if through_decode:  # every row a decode row, rows longer than 1 + k among them
        assert all(prefills == 0 for _, prefills, _ in builds)
        assert max(q for _, _, q in builds) > 1 + 3  # (k = 3)
    else:
        assert any(prefills > 0 for _, prefills, _ in builds)
    passes, tokens = refilled["refills"]
    assert passes >= 1 and tokens > passes  # plain steps skipped the write and were refilled
    assert direct["refills"] == (0, 0)
    assert refilled["tokens"] == direct["tokens"]
    assert refilled["num_drafts"] == direct["num_drafts"] > 0
    # float32 on the CPU: the refill's prefill-shaped forward gives the same drafts
    assert refilled["drafts"] == direct["drafts"]
    assert refilled["accepted"] == direct["accepted"]
    # The check can fail: without the refill the drafter reads stale context KV, and its
    # drafts change (the verified tokens do not).
    dropped = run_switching_engine(monkeypatch, False, refill=True, drop_refill=True, **common)
    assert dropped["tokens"] == direct["tokens"]
    assert dropped["drafts"] != direct["drafts"]


@pytest.mark.slow
def test_a_refill_in_small_passes_writes_no_target_kv(monkeypatch):
    """Refills cut into passes of at most 5 tokens and 2 rows (requests split across passes):
    the target's KV cache is bit for bit what it was, the
    drafter's holds new context KV, and the drafts still equal the written context's."""
    import vllm.v1.worker.gpu.model_runner as model_runner

    snapshots = []
    cut = model_runner.chunk_pieces

    def small_passes(pieces, max_tokens, max_rows):
        return cut(pieces, 5, 2)
    monkeypatch.setattr(model_runner, "chunk_pieces", small_passes)
    refill = model_runner.GPUModelRunner._refill_draft_context

    def checked_refill(runner, scheduler_output):
        target = {name for g in runner._target_group_ids
                  for name in runner.kv_cache_config.kv_cache_groups[g].layer_names}
        before = {name: cache.clone() for name, cache in runner.kv_caches.items()}
        refill(runner, scheduler_output)
        changed = {name for name, cache in runner.kv_caches.items()
                   if not torch.equal(cache, before[name])}
        snapshots.append((target, changed, set(runner.kv_caches)))
    monkeypatch.setattr(model_runner.GPUModelRunner, "_refill_draft_context", checked_refill)
    direct = run_switching_engine(monkeypatch, False)
    refilled = run_switching_engine(monkeypatch, False, refill=True)
    passes, tokens = refilled["refills"]
    assert passes >= 1 and tokens > 10  # more than two passes' worth: cut into several
    assert refilled["drafts"] == direct["drafts"]
    assert refilled["tokens"] == direct["tokens"]
    nonempty = [s for s in snapshots if s[1]]
    assert nonempty
    for target, changed, every in nonempty:
        assert not changed & target  # no target KV written
        assert changed == every - target  # every drafter layer's context KV was


@pytest.mark.slow
def test_the_start_up_warm_up_writes_no_target_kv_and_changes_no_output(monkeypatch):
    """The refill's start-up passes (run on CUDA only; here forced on the CPU) write only the
    drafter's cache, count as no refill, and serving after them is unchanged."""
    import vllm.v1.worker.gpu.model_runner as model_runner

    warm = model_runner.GPUModelRunner._warm_context_refill
    seen = []

    def warm_on_cpu(runner, on_cpu=False):
        before = {name: cache.clone() for name, cache in runner.kv_caches.items()}
        warm(runner, on_cpu=True)
        target = {name for g in runner._target_group_ids
                  for name in runner.kv_cache_config.kv_cache_groups[g].layer_names}
        changed = {name for name, cache in runner.kv_caches.items()
                   if not torch.equal(cache, before[name])}
        seen.append((runner._context_refill is not None, changed & target,
                     changed == set(runner.kv_caches) - target, runner.context_refills))
    monkeypatch.setattr(model_runner.GPUModelRunner, "_warm_context_refill", warm_on_cpu)
    direct = run_switching_engine(monkeypatch, False)
    refilled = run_switching_engine(monkeypatch, False, refill=True)
    # the writing engine has no refill (nothing runs); the refilling one wrote drafter KV only
    assert seen == [(False, set(), False, 0), (True, set(), True, 0)]
    assert refilled["tokens"] == direct["tokens"]
    assert refilled["drafts"] == direct["drafts"]


# ---- under DCP (CPU, gloo), through the real runner (tests/utils/runner_harness.py) ---------
DCP_PROMPTS = {"long": [(7 * i * i + 3 * i + 11) % 250 + 4 for i in range(14)],
               "short": [84, 104, 101, 32, 113], "prose": list(b"The engine serves the model")}
# drafting pauses after steps 4-10 (a policy's propose_drafts=False): the Q=1 steps among them
# skip the context write, and the draft pass after step 11 reads the refilled context
DCP_SCENARIO = Scenario("refill", DCP_PROMPTS, max_new_tokens=16, prefill_chunk=6,
                        pause_steps=frozenset(range(4, 11)))
# (the drafter sharded like the target, and replicated: draft_decode_context_parallel_size=1)
DCP_CASES = [("dspark", 4), ("dspark", 4, None, "refill"), ("dspark", 4, 1),
             ("dspark", 4, 1, "refill")]


@pytest.mark.slow
@pytest.mark.parametrize("dcp", [1, 2])
def test_refill_under_dcp_proposes_what_the_written_context_proposes(cpu_world_pool, dcp,
                                                                     monkeypatch):
    paths = write_tiny_models()
    paths = {"target": paths.target, "dspark": paths.dspark}
    oracle = greedy_oracle(make_runner(make_config(paths["target"])).model, DCP_PROMPTS,
                           DCP_SCENARIO.max_new_tokens)
    if dcp == 1:
        results = run_all_methods(paths, DCP_CASES[:2], DCP_SCENARIO, oracle)
        # The check can fail: with the refill's passes left out, the proposals change.
        import vllm.v1.worker.gpu.model_runner as model_runner
        monkeypatch.setattr(model_runner.GPUModelRunner, "_refill_pieces", lambda *a: None)
        stale = run_all_methods(paths, DCP_CASES[1:2], DCP_SCENARIO, oracle)["dspark+refill"]
        assert stale.outputs == oracle and stale.proposals != results["dspark"].proposals
    else:
        results, _ = cpu_world_pool.run_dcp_world(dcp, 1, paths, DCP_CASES, DCP_SCENARIO, oracle)
    for written in [key for key in results if not key.endswith("+refill")]:
        refilled = results[written + "+refill"]
        assert refilled.outputs == results[written].outputs == oracle, written
        passes, tokens = refilled.context_refills
        assert passes >= 1 and tokens >= 2 * len(DCP_PROMPTS), written  # the pause was refilled
        assert results[written].context_refills == (0, 0)
        assert refilled.proposals == results[written].proposals, written  # float32: identical


@pytest.mark.parametrize("max_num_seqs", [1, 2])
def test_the_warm_up_fits_any_batch_size(monkeypatch, max_num_seqs):
    """Its passes use as many rows as the engine's batch holds (a two-row pass once indexed
    slot 1 of a max_num_seqs=1 engine on the GPU)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine
    monkeypatch.setenv(ENV_FLAG, "1")
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=None, device="cpu", dtype="float32", max_model_len=64, max_num_seqs=max_num_seqs,
        speculative_config={"method": "dspark", "num_speculative_tokens": 3,
                            "disable_by_batch_size": "auto"}))
    try:
        runner = engine.executor.worker.model_runner
        passes = []
        monkeypatch.setattr(runner, "_refill_pieces", lambda pieces: passes.append(
            [p.state.slot for p in pieces]))
        runner._warm_context_refill(on_cpu=True)
        assert passes and all(max(slots) < max_num_seqs for slots in passes)
        assert max(len(slots) for slots in passes) == max_num_seqs  # multi-row where it fits
    finally:
        engine.shutdown()


def test_the_flag_is_refused_with_deferral_and_said_to_do_nothing_without_a_policy(
        monkeypatch, caplog):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.worker.gpu.spec_decode.context_kv_ring import ENV_FLAG as DEFER

    def build(policy):
        return LLMEngine.from_engine_args(EngineArgs(
            model=None, device="cpu", dtype="float32", max_model_len=64, max_num_seqs=2,
            speculative_config={"method": "dspark", "num_speculative_tokens": 3,
                                "disable_by_batch_size": policy}))
    monkeypatch.setenv(ENV_FLAG, "1")
    monkeypatch.setenv(DEFER, "1")
    with pytest.raises(ValueError, match=f"{ENV_FLAG}=1 and {DEFER}=1"):
        build("auto")
    monkeypatch.setenv(DEFER, "0")
    with caplog.at_level("WARNING"):
        engine = build(None)  # every step proposes: nothing to skip
    try:
        assert engine.executor.worker.model_runner._context_refill is None
        assert f"{ENV_FLAG}=1 has no effect without speculative_config disable_by_batch_size" \
            in caplog.text
    finally:
        engine.shutdown()
