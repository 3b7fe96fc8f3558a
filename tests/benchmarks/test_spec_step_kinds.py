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


def test_plan_counts_are_split_by_kv_cache_group():
    """StepKinds charges each step the FlashInfer plans, re-plans and refreshes its builders
    made, per KV cache group (stand-in builders whose slot counters a fake step advances)."""
    from types import SimpleNamespace

    from vllm.benchmarks.spec_step_kinds import StepKinds, flashinfer_plan_counts

    def slot():
        return SimpleNamespace(full_plans=0, native_replans=0, refreshes=0)

    target, draft = slot(), slot()
    builders = [SimpleNamespace(_slots={}, _graph_slots={(1, "q1"): target}),
                SimpleNamespace(_slots={"block": draft}, _graph_slots={}), SimpleNamespace()]
    runner = SimpleNamespace(attn_metadata_builders=builders, speculator=None)
    moves = iter([(target, "refreshes"), (draft, "native_replans"), (draft, "full_plans")])

    class Scheduler:
        def schedule(self):
            return SimpleNamespace(scheduled_spec_decode_tokens={}, propose_drafts=False)

    engine = SimpleNamespace(executor=SimpleNamespace(worker=SimpleNamespace(model_runner=runner)),
                             scheduler=Scheduler())
    kinds = StepKinds(engine)
    for _ in range(2):
        kinds.before()
        engine.scheduler.schedule()
        owner, counter = next(moves)
        setattr(owner, counter, getattr(owner, counter) + 1)
        kinds.after(1.0, {})
    kinds.restore()
    row = kinds.summary()["plain"]
    assert row["steps"] == 2 and row["native_replans_per_step"] == 0.5
    assert row["full_plans_per_step"] == 0
    assert row["plans_per_step_by_group"] == [
        {"full": 0.0, "native": 0.0, "refresh": 0.5}, {"full": 0.0, "native": 0.5, "refresh": 0.0},
        {"full": 0.0, "native": 0.0, "refresh": 0.0}]
    assert flashinfer_plan_counts(runner) == (0, 1)


def test_host_written_plans_and_put_backs_are_counted_per_group():
    """The probe's plan counters read each builder's graph and eager slots' refreshers (a slot
    without one counts nothing)."""
    from types import SimpleNamespace

    from vllm.benchmarks.spec_step_kinds import host_written_plans, plan_cache_put_backs

    def slot(host, put_backs):
        return SimpleNamespace(refresher=SimpleNamespace(host_plans=host,
                                                         cache_put_backs=put_backs))

    builders = [SimpleNamespace(_slots={"a": slot(1, 2)}, _graph_slots={(1, "q"): slot(3, 5)}),
                SimpleNamespace(_slots={"b": SimpleNamespace(refresher=None)}),
                SimpleNamespace()]
    runner = SimpleNamespace(attn_metadata_builders=builders)
    assert host_written_plans(runner) == [4, 0, 0]
    assert plan_cache_put_backs(runner) == [7, 0, 0]
