"""Engines of the deferred context-KV tests (CPU and GPU): a DSpark / DFlash engine whose drafting
switches off while 2+ requests run (disable_by_batch_size=2) and back on when one finishes, so
Q=1 plain steps queue context rows and the resumed draft passes read them. "late" arrives after
"short" finished and takes over freed blocks."""
from __future__ import annotations

from tests.utils.engine_steps import greedy, run_with_arrivals

REQUESTS = {"long": ([7, 19, 31, 43, 55, 67, 79, 91], greedy(72)),
            "short": ([200, 3, 9, 27], greedy(20)),
            "late": ([11, 22, 33, 44, 55], greedy(30))}
ARRIVALS = {"late": 40}
# The GPU tests' settings: each drafter on both backends, with CUDA graphs.
GRAPH_CASES = [(method, backend, dtype) for method in ("dspark", "dflash")
               for backend, dtype in (("TORCH_MLA", "float32"), ("FLASHINFER_MLA", "bfloat16"))]


def graph_settings(method: str, backend: str, dtype: str) -> dict:
    """run_switching_engine's keywords for one of GRAPH_CASES."""
    return dict(method=method, device="cuda", dtype=dtype, attention_backend=backend,
                enforce_eager=False)


def run_switching_engine(monkeypatch, defer: bool, *, method: str = "dspark",
                         async_scheduling=False, drop_flush: bool = False, device: str = "cpu",
                         dtype: str = "float32", attention_backend: str = "TORCH_MLA",
                         enforce_eager: bool = True, refill: bool = False,
                         drop_refill: bool = False) -> dict:
    """Run REQUESTS; -> tokens per request, every draft pass's drafts, acceptance counts and
    the sizes of the non-empty flushes. `drop_flush`: queued rows are discarded instead of
    written (what a missing flush would leave). `refill`: plain steps skip the context write
    and it is refilled before draft passes (context_refill.py; "refills" counts the refill
    passes and tokens); `drop_refill`: the stale rows are forgotten instead of refilled."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.worker.gpu.spec_decode.context_kv_ring import ENV_FLAG
    from vllm.v1.worker.gpu.spec_decode.context_refill import ENV_FLAG as REFILL_FLAG

    monkeypatch.setenv(ENV_FLAG, "1" if defer else "0")
    monkeypatch.setenv(REFILL_FLAG, "1" if refill else "0")
    spec = {"method": method, "num_speculative_tokens": 3, "disable_by_batch_size": 2}
    extra = {} if device == "cuda" else {"device": device}
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=None, dtype=dtype, attention_backend=attention_backend,
        enforce_eager=enforce_eager, max_model_len=192, max_num_seqs=4,
        speculative_config=spec, async_scheduling=async_scheduling, seed=0, **extra))
    try:
        runner = engine.executor.worker.model_runner
        speculator = runner.speculator
        flushed, drafts = [], []
        propose = runner._propose

        def recording_propose(*args, **kwargs):
            # Every draft pass, whichever way it ran: speculator.propose, or a draft step
            # launched early (consume_early_launch, CUDA graphs on FlashInfer), which does
            # not call propose. Both leave the pass's drafts in _last_drafts.
            out = propose(*args, **kwargs)
            req_ids, step_drafts = runner._last_drafts
            drafts.append(step_drafts[:len(req_ids)].tolist())
            return out
        runner._propose = recording_propose
        context_free = []  # replays of the Q=1 graphs captured without the context write
        graphs = runner._context_free_graphs
        if graphs is not None:
            replay = graphs.replay

            def counted_replay(size):
                context_free.append(size)
                return replay(size)
            graphs.replay = counted_replay
        if drop_refill:
            tracker = runner._context_refill

            def forget_stale(scheduler_output):
                by_id = runner.requests.by_id
                tracker.refilled(tracker.stale_pieces(
                    [by_id[r] for r in scheduler_output.num_scheduled_tokens if r in by_id]))
            runner._refill_draft_context = forget_stale
        if defer:
            inner = speculator.flush_context

            def flush():
                pending = speculator._context_ring().pending
                if drop_flush:
                    speculator.reset_context()
                    return False
                flushed.append(pending)
                return inner()
            speculator.flush_context = flush
        outputs = run_with_arrivals(engine, REQUESTS, ARRIVALS)
        stats = engine.scheduler.get_stats()["spec_decode"]
        return {"tokens": {r: o[0] for r, o in outputs.items()},
                "accepted": stats["num_accepted_tokens"], "num_drafts": stats["num_drafts"],
                "drafts": drafts, "flushed": [n for n in flushed if n],
                "refills": (runner.context_refills, runner.context_refill_tokens),
                "context_free_replays": len(context_free)}
    finally:
        engine.shutdown()


def check_graphs_against_writing(monkeypatch, common: dict, variant: dict,
                                 dropped: dict) -> tuple[dict, dict]:
    """The GPU tests' shared check of a way to write context KV other than in every step
    (`variant`: run_switching_engine's keywords, e.g. defer=True): with graphs and eagerly, its
    greedy tokens equal writing in every step, and its drafts agree with it to >= 0.9 (bf16
    may round the batched or refilled KV differently), while `dropped` (the same with its
    writes left out) agrees less. -> (the variant's run, the eager variant's run)."""
    defer = variant.pop("defer", False)
    direct = run_switching_engine(monkeypatch, False, **common)
    run = run_switching_engine(monkeypatch, defer, **common, **variant)
    eager = run_switching_engine(monkeypatch, defer, **{**common, "enforce_eager": True},
                                 **variant)
    assert run["tokens"] == direct["tokens"] == eager["tokens"]
    agree = draft_agreement(run["drafts"], direct["drafts"])
    assert agree >= 0.9, agree
    assert draft_agreement(eager["drafts"], run["drafts"]) >= 0.9
    lost = run_switching_engine(monkeypatch, defer, **common, **variant, **dropped)
    assert lost["tokens"] == direct["tokens"]
    assert draft_agreement(lost["drafts"], direct["drafts"], strict=False) < agree
    return run, eager


def draft_agreement(a: list, b: list, strict: bool = True) -> float:
    """Share of draft positions equal between two runs' draft passes (same passes in order).
    `strict`: the runs must have made the same passes (a mismatch in their number or shapes
    raises: for runs that should agree it is a recording fault, not a disagreement); else a
    mismatch counts as no agreement (drafts bad enough to change acceptance, hence the
    passes)."""
    flat_a = [t for step in a for row in step for t in row]
    flat_b = [t for step in b for row in step for t in row]
    if not flat_a or len(flat_a) != len(flat_b):
        if not strict:
            return 0.0
        raise AssertionError(f"draft passes differ: {len(a)} passes / {len(flat_a)} drafts "
                             f"against {len(b)} / {len(flat_b)}")
    return sum(x == y for x, y in zip(flat_a, flat_b)) / len(flat_a)
