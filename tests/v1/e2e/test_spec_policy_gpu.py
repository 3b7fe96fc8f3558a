"""GPU (H200): where drafting cannot pay, the "auto" policy brings tok/s back to within 5% of no
speculation, and where it pays (the tiny DSpark drafter's real acceptance) it keeps drafting;
greedy tokens equal no speculation in every mode. CUDA graphs on, bf16, FlashInfer MLA."""
import json

import pytest

from vllm.benchmarks.spec_policy import SpecPolicyCase, run_case, run_interleaved

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def best_of(case: SpecPolicyCase, repeats: int = 2) -> dict:
    return max((run_case(case) for _ in range(repeats)), key=lambda r: r["tok_s"])


@pytest.mark.parametrize("context_kv", ["write", "defer", "refill"])
@pytest.mark.parametrize("scheduling", ["sync", "async"])
@pytest.mark.parametrize("batch", [1, 8])
def test_speculation_that_cannot_pay_costs_at_most_5_percent(batch, scheduling, context_kv):
    # Against plain decoding scheduled the same way. "async": both as the engine schedules
    # them by default (async; a DSpark engine under a policy overlaps the steps the policy
    # leaves without drafts). "sync": both synchronous. Both engines are alive at once and
    # stepped in turn in blocks of 16 steps (run_interleaved says why: one engine's step time
    # moves by up to 2x between processes on the node, the 5 % asked is far below that);
    # every block is timed whole, so exploration, probes and stalls count. "defer": the
    # drafter's context KV of Q=1 steps is queued and written in batches
    # (VLLM_DEFER_DRAFT_CONTEXT_KV=1, context_kv_ring.py); "write": written in every step;
    # "refill": plain steps skip it and it is refilled before a probe's draft pass
    # (VLLM_DRAFT_CONTEXT_REFILL=1, context_refill.py).
    overlap = None if scheduling == "async" else False
    common = dict(output_len=768, warmup_steps=32, async_scheduling=overlap,
                  defer_context_kv=context_kv == "defer",
                  refill_context_kv=context_kv == "refill")
    runs = run_interleaved({"none": SpecPolicyCase("none", batch, **common),
                            "auto-nopay": SpecPolicyCase("auto-nopay", batch, **common)})
    base, nopay = runs["none"], runs["auto-nopay"]
    # bf16: the first 256 tokens, as this test checked with 256-token runs (equal in every
    # run of sessions 5-8 but one, the eighth session's AD, a near-tie at B=8). Later the tiny
    # model settles into runs of one byte where a near-tie between the Q = 1 + k verify GEMMs
    # and the Q = 1 ones flips a token more often: one request at B=8 differed in the
    # 768-token runs of the ninth session (where first was not recorded; the message now
    # says). Token identity in every mode is the float32 test's (below).
    first = [next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), None)
             for x, y in zip(base["tokens"], nopay["tokens"])]
    assert [t[:256] for t in nopay["tokens"]] == [t[:256] for t in base["tokens"]], first
    assert nopay["policy"]["num_skipped"].get("cost", 0) > nopay["policy"]["num_drafted"]
    ratio = nopay["tok_s"] / base["tok_s"]
    rounds = sorted(a / b for a, b in zip(nopay["block_tok_s"], base["block_tok_s"]))
    # (printed for the record: -rA shows it for a passing run too)
    print(f"cannot-pay B={batch} {scheduling} {context_kv}: ratio {ratio:.3f}, median block "
          f"{rounds[len(rounds) // 2]:.3f}, {runs['_rounds']} rounds")
    assert ratio >= 0.95, (ratio, runs["_rounds"], "median block ratio",
                           rounds[len(rounds) // 2], nopay["policy"])


def test_auto_keeps_drafting_where_it_pays():
    # Both synchronous: there a DSpark step costs ~1.65 plain steps on the H100 (1.24 vs 0.75 ms,
    # run EB) and the tiny drafter gains ~3.15 tokens a step at B=1, so drafting pays ~1.9x.
    # Not against async plain steps: they overlap and cost ~0.45 ms, a DSpark step ~3 of them,
    # so at AL 3.15 drafting is break-even there (always / none 1.027, run EC), inside the
    # policy's hysteresis band, and "auto" stopped (nineteenth session, run FG: 31 drafted,
    # 170 skipped for cost).
    base = best_of(SpecPolicyCase("none", 1, async_scheduling=False))
    auto = best_of(SpecPolicyCase("auto", 1, async_scheduling=False))
    assert auto["tokens"] == base["tokens"]
    # The distilled tiny drafter gains ~4 tokens per step (CPU: 4.2-4.7 at k=4).
    assert auto["mean_acceptance_length"] > 2.0
    assert auto["policy"]["num_drafted"] > auto["policy"]["num_skipped"].get("cost", 0)
    assert auto["tok_s"] > base["tok_s"]


def test_greedy_tokens_identical_in_every_mode_float32():
    # bf16 verify rows (Q = 1 + k) and plain rows (Q = 1) reduce in different GEMM tile orders,
    # so a near-tie can flip late in a long bf16 run (seen at B=8); in float32 the policy modes
    # must agree token for token: the policy changes what is drafted, never what is emitted.
    common = dict(batch=8, output_len=96, warmup_steps=16, dtype="float32",
                  attention_backend="TORCH_MLA")
    base = run_case(SpecPolicyCase("none", **common))["tokens"]
    for variant in ("always", "never", "auto", "auto-nopay"):
        assert run_case(SpecPolicyCase(variant, **common))["tokens"] == base, variant
    # Synchronous too: the default overlaps the policy's plain steps (async), and its decisions
    # follow measured times of another schedule; which rows verify when changes, tokens not.
    for variant in ("auto", "auto-nopay"):
        case = SpecPolicyCase(variant, async_scheduling=False, **common)
        assert run_case(case)["tokens"] == base, (variant, "sync")


@pytest.mark.parametrize("batch", [1, 8])
def test_probe_steps_cost_what_steady_spec_steps_cost(batch):
    """The policy's probe steps ("auto", drafting cannot pay, a re-probe every 8 steps) against
    the steps of an engine drafting every step: a probe's verify step and its propose-only step
    (Q=1 target + draft pass) must cost about what a steady verify step costs, and no step of a
    warm engine may make a full FlashInfer plan (a wrapper shared by the Q=1 and the verify
    graphs made two per probe; wrappers are keyed by decode kind since)."""
    from vllm.benchmarks.spec_step_kinds import measure_step_kinds
    probes = measure_step_kinds("auto", batch, steps=160, warmup=32, probe_interval=8)
    steady = measure_step_kinds(None, batch, steps=60, warmup=16)
    summary = {k: {f: round(v, 3) for f, v in d.items() if isinstance(v, (int, float))}
               for k, d in probes.items()}
    # the whole per-kind summary (plans per group, phases) for a failure report
    print(json.dumps({"probes": probes, "steady": steady}, default=str))
    assert probes["verify"]["steps"] >= 10, summary
    for kind, row in probes.items():
        assert row["full_plans_per_step"] == 0, (kind, summary)
    assert steady["verify"]["full_plans_per_step"] == 0, steady
    verify_ms = steady["verify"]["median_ms"]
    assert probes["verify"]["median_ms"] <= 1.25 * verify_ms, (verify_ms, summary)
    assert probes["propose-only"]["median_ms"] <= 1.25 * verify_ms, (verify_ms, summary)
