"""The speculation-policy benchmark's runner on the tiny model (CPU): every variant decodes the
same greedy tokens as no speculation, and the policies' decisions are what each variant means."""
import os

import pytest

from vllm.benchmarks.spec_policy import VARIANTS, SpecPolicyCase, run_case

pytestmark = pytest.mark.slow


def test_every_variant_decodes_the_same_greedy_tokens():
    rows = {v: run_case(SpecPolicyCase(v, 2, context=16, output_len=48, warmup_steps=8,
                                       num_spec_tokens=3, device="cpu", dtype="float32",
                                       attention_backend="TORCH_MLA", enforce_eager=True))
            for v in VARIANTS}
    for v, row in rows.items():
        assert row["tokens"] == rows["none"]["tokens"], v
        assert row["timed_tokens"] > 0 and row["tok_s"] > 0
    assert rows["never"]["num_drafts"] == 0
    assert rows["always"]["policy"]["mode"] == "always" and rows["always"]["num_drafts"] > 0
    assert rows["auto-nopay"]["policy"]["num_skipped"]["cost"] > 0


def test_bad_cases_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="variant='sometimes' is invalid"):
        SpecPolicyCase("sometimes", 1)
    with pytest.raises(ValueError, match="warmup_steps=64 must be smaller than output_len=64"):
        SpecPolicyCase("none", 1, output_len=64, warmup_steps=64)
    with pytest.raises(ValueError, match="prompt_stagger=-1 is invalid"):
        SpecPolicyCase("none", 2, prompt_stagger=-1)


def test_staggered_prompts_differ_by_the_stagger():
    from vllm.benchmarks.spec_policy import build_engine
    engine = build_engine(SpecPolicyCase("none", 3, context=16, output_len=8, warmup_steps=2,
                                         device="cpu", dtype="float32",
                                         attention_backend="TORCH_MLA", enforce_eager=True,
                                         prompt_stagger=5))
    try:
        requests = engine.scheduler.requests
        assert [requests[f"r{i}"].num_prompt_tokens for i in range(3)] == [16, 21, 26]
    finally:
        engine.shutdown()




def test_policy_rounds_pair_tok_s_within_a_round():
    from vllm.benchmarks.spec_policy import paired_ratio, run_rounds
    calls = []

    def fake(case):
        calls.append(case.variant)
        return {"tok_s": 100.0 * (1.0 if case.variant == "none" else 0.96) * 0.9 ** len(calls)}

    runs = run_rounds({v: SpecPolicyCase(v, 1) for v in ("none", "never")}, 2, run=fake,
                      warmup_rounds=1)
    assert calls == ["none", "never", "never", "none", "none", "never"]
    ratio, ratios = paired_ratio(runs["never"], runs["none"])
    assert ratios == pytest.approx([0.96 / 0.9, 0.96 * 0.9]) and ratio == pytest.approx(0.96)


def test_interleaved_blocks_are_full_rounds_and_outputs_complete():
    from vllm.benchmarks.spec_policy import run_interleaved
    common = dict(context=16, output_len=64, warmup_steps=8, num_spec_tokens=3, device="cpu",
                  dtype="float32", attention_backend="TORCH_MLA", enforce_eager=True)
    runs = run_interleaved({"none": SpecPolicyCase("none", 2, **common),
                            "auto-nopay": SpecPolicyCase("auto-nopay", 2, **common)},
                           steps_per_block=8)
    rounds = runs["_rounds"]
    # 56 steps after the warm-up: 7 full blocks of 8 while both engines run.
    assert 1 <= rounds <= 7
    for name in ("none", "auto-nopay"):
        run = runs[name]
        assert len(run["blocks"]) == len(run["block_tok_s"]) == rounds
        assert all(t > 0 and s > 0 for t, s in run["blocks"])
        tokens = sum(t for t, _ in run["blocks"])
        assert run["tok_s"] == pytest.approx(tokens / sum(s for _, s in run["blocks"]))
        # The untimed rest ran too: every request has its full output.
        assert [len(t) for t in run["tokens"]] == [64, 64]
    assert runs["auto-nopay"]["tokens"] == runs["none"]["tokens"]
    with pytest.raises(ValueError, match="steps_per_block=0 is invalid"):
        run_interleaved({"none": SpecPolicyCase("none", 1, **common)}, steps_per_block=0)


def test_flag_cases_reach_the_drafter_and_leave_the_environment_as_it_was(monkeypatch):
    from vllm.benchmarks.spec_policy import build_engine
    from vllm.model_executor.layers.attention.mla_context_kv_writer import ENV_FLAG as FUSED
    monkeypatch.setenv(FUSED, "1")
    engine = build_engine(SpecPolicyCase("always", 1, context=16, output_len=4, warmup_steps=1,
                                         device="cpu", dtype="float32",
                                         attention_backend="TORCH_MLA", enforce_eager=True,
                                         fused_context_kv=False))
    try:
        drafter = engine.executor.worker.model_runner.speculator.model
        assert drafter.fused_context_kv is False  # read while the engine was built
        assert os.environ[FUSED] == "1"  # restored
    finally:
        engine.shutdown()


def test_a_row_says_whether_the_early_draft_tuner_had_decided_when_timing_began(monkeypatch):
    """`early_draft_at_timing`: the tuner's decision for the batch when the timed steps begin
    ("trial" means some timed steps ran its trial), "-" without a tuner (the CPU engine)."""
    from types import SimpleNamespace

    from vllm.benchmarks import spec_policy
    case = SpecPolicyCase("always", 1, context=16, output_len=12, warmup_steps=4,
                          num_spec_tokens=3, device="cpu", dtype="float32",
                          attention_backend="TORCH_MLA", enforce_eager=True)
    assert run_case(case)["early_draft_at_timing"] == "-"
    asked = []
    stub = SimpleNamespace(history=[], decision=lambda n: asked.append(n) or "trial")
    monkeypatch.setattr(spec_policy, "early_draft_tuner", lambda engine: stub)
    row = run_case(case)
    assert row["early_draft_at_timing"] == "trial" and asked == [1]
