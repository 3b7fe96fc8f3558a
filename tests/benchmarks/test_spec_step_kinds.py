"""The step-kind timer (vllm/benchmarks/spec_step_kinds.py) on the tiny model (CPU): every timed
step is classified, and its kinds are what the policy did: "auto" with drafting that cannot pay
and a re-probe every 6 steps shows plain steps and probes (a propose-only step, then a verify
step, then a plain step after it); drafting every step shows verify steps only."""
from vllm.benchmarks.spec_step_kinds import measure_step_kinds

CPU = dict(device="cpu", dtype="float32", attention_backend="TORCH_MLA", enforce_eager=True,
           num_spec_tokens=3, context=16)


def test_auto_probes_show_as_propose_only_verify_and_plain_after_verify():
    kinds = measure_step_kinds("auto", 2, steps=30, warmup=10, probe_interval=6, **CPU)
    assert sum(k["steps"] for k in kinds.values()) == 30
    for kind in ("plain", "propose-only", "verify", "plain after verify"):
        assert kinds[kind]["steps"] >= 2, kinds
    # A probe lasts probe_len = 2 steps: one propose-only, one verify (then a plain step).
    assert abs(kinds["propose-only"]["steps"] - kinds["verify"]["steps"]) <= 1
    assert kinds["plain"]["steps"] > kinds["verify"]["steps"]
    assert all(k["full_plans_per_step"] == 0 for k in kinds.values())  # no FlashInfer on CPU


def test_drafting_every_step_is_all_verify():
    kinds = measure_step_kinds(None, 2, steps=8, warmup=4, **CPU)
    assert set(kinds) == {"verify"} and kinds["verify"]["steps"] == 8
