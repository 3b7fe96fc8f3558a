"""The speculation-policy benchmark's runner on the tiny model (CPU): every variant decodes the
same greedy tokens as no speculation, and the policies' decisions are what each variant means."""
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



def test_rounds_alternate_the_order_and_paired_ratios_cancel_a_steady_drift():
    from vllm.benchmarks.spec_policy import paired_ratio, run_rounds
    calls = []

    # A machine that slows down steadily: each run is 10 % slower than the one before. A best-of
    # comparison favours whatever ran first; rounds in alternating order over an even count see
    # the true 0.96.
    def fake(case):
        calls.append(case.variant)
        return {"tok_s": 100.0 * (1.0 if case.variant == "none" else 0.96) * 0.9 ** len(calls)}

    cases = {v: SpecPolicyCase(v, 1) for v in ("none", "never")}
    runs = run_rounds(cases, 4, run=fake)
    assert calls == ["none", "never", "never", "none"] * 2
    ratio, ratios = paired_ratio(runs["never"], runs["none"])
    assert len(ratios) == 4 and ratio == pytest.approx(0.96)
    # while the best of each variant's runs compares runs of different moments (0.864 here)
    best = max(r["tok_s"] for r in runs["never"]) / max(r["tok_s"] for r in runs["none"])
    assert best == pytest.approx(0.96 * 0.9)
    with pytest.raises(ValueError, match="as many runs as base runs"):
        paired_ratio(runs["never"][:2], runs["none"])
    with pytest.raises(ValueError, match="rounds=0 is invalid"):
        run_rounds(cases, 0, run=fake)
    calls.clear()
    runs = run_rounds(cases, 2, run=fake, warmup_rounds=1)  # the first round is dropped
    assert calls == ["none", "never", "never", "none", "none", "never"]
    assert [r["tok_s"] for r in runs["none"]] == pytest.approx([100 * 0.9 ** 4, 100 * 0.9 ** 5])
