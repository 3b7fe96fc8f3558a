"""Decode tok/s under each speculation policy (benchmarks/engine/benchmark_spec_policy.py and the
GPU test of "speculation that cannot pay costs nothing" share it).

Variants: "none" (no speculation), "always" (drafting every step), "never"
(disable_by_batch_size=1), "auto" (the cost model on measured step times and real acceptance),
"auto-nopay" ("auto" with the cost model's acceptance forced to `forced_acceptance`, 1.0 = every
draft counted as rejected: drafting cannot pay, so the engine must stop drafting).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any

from vllm.benchmarks.datasets import spec_bench_prompt
from vllm.benchmarks.gc_pauses import GcPauses
from vllm.benchmarks.rounds import alternating_rounds
from vllm.benchmarks.rounds import paired_ratio as paired_tok_ratio
from vllm.benchmarks.warmup import early_draft_tuner

VARIANTS = ("none", "always", "never", "auto", "auto-nopay")
_POLICY = {"always": None, "never": 1, "auto": "auto", "auto-nopay": "auto"}


@dataclass
class SpecPolicyCase:
    variant: str
    batch: int
    # Prompt tokens per request. None: 64 for the built-in tiny model (trained on 129-byte
    # windows; at 1024 tokens its drafters' acceptance drops to ~1.3), 1024 otherwise.
    context: int | None = None
    output_len: int = 256
    warmup_steps: int = 32       # untimed: prefill, graph warm-up, the cost model's exploration
    method: str = "dspark"
    num_spec_tokens: int = 4
    model: str | None = None     # None: the built-in tiny model (and its drafter)
    draft_model: str | None = None
    load_format: str = "auto"    # "dummy": seeded random weights from config.json alone
    forced_acceptance: float = 1.0
    device: str = "cuda"
    dtype: str = "bfloat16"
    attention_backend: str = "FLASHINFER_MLA"
    enforce_eager: bool = False
    # None: the engine's default (async scheduling where supported: plain decoding, and DSpark /
    # DFlash under a policy, i.e. "none", "never", "auto", "auto-nopay"; "always" runs
    # synchronously). False: synchronous, so that a comparison isolates the drafting policy
    # from the scheduling mode.
    async_scheduling: bool | None = None
    # None: gpu_memory_utilization sizes the KV cache. run_interleaved sets 1 GiB, so that
    # several engines fit on one GPU at once.
    kv_cache_memory_bytes: int | None = None
    # Block drafters' deferred context-KV writes (VLLM_DEFER_DRAFT_CONTEXT_KV, read when the
    # engine is built): None = the environment's setting.
    defer_context_kv: bool | None = None
    # Block drafters' context KV refilled before draft passes instead of written in plain
    # steps (VLLM_DRAFT_CONTEXT_REFILL, read when the engine is built; context_refill.py):
    # None = the environment's setting.
    refill_context_kv: bool | None = None
    # Block drafters' fused context-KV write (VLLM_FUSED_DRAFT_CONTEXT_KV, read when the drafter
    # is built; mla_context_kv_writer.py): None = the environment's setting.
    fused_context_kv: bool | None = None
    # CostModelConfig fields to override for "auto" / "auto-nopay" (e.g. {"probe_interval":
    # 10**6, "max_probe_interval": 10**6}: no re-probes, to price them), as (name, value) pairs.
    cost_model_config: tuple[tuple[str, object], ...] = ()
    # Block drafters' early draft step (early_draft.py): None = the environment's setting,
    # else one of its modes ("auto", "1", "0") for this engine alone, or "auto-fixed" (an
    # eligible "auto" kept on, without its measured A/B: EarlyDraftTuner).
    early_draft: str | None = None
    # Request i's prompt has context + i * prompt_stagger tokens. 0 (the default): equal
    # prompts, so a plain engine's requests cross block and KV-chunk boundaries in the same
    # step; a few tokens apart they cross in different steps, as requests whose drafts were
    # accepted unevenly do (the lock-step baseline pays those per-step costs once for all).
    prompt_stagger: int = 0

    def __post_init__(self):
        if self.cost_model_config and _POLICY.get(self.variant) != "auto":
            raise ValueError(f"cost_model_config is set but variant={self.variant!r} has no cost "
                             "model: use 'auto' or 'auto-nopay'")
        if self.context is None:
            self.context = 64 if self.model is None else 1024
        if self.variant not in VARIANTS:
            raise ValueError(f"variant={self.variant!r} is invalid: use one of {list(VARIANTS)}")
        if not isinstance(self.prompt_stagger, int) or self.prompt_stagger < 0:
            raise ValueError(f"prompt_stagger={self.prompt_stagger!r} is invalid: it must be an "
                             "int >= 0 (tokens added per request index)")
        if self.warmup_steps >= self.output_len:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be smaller than output_len="
                             f"{self.output_len}: nothing would be timed")


def add_engine_args(parser) -> None:
    """The engine options every policy tool takes (GPU defaults): --device, --dtype,
    --attention-backend, --enforce-eager; `engine_kwargs(args)` turns them into
    SpecPolicyCase fields."""
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention-backend", default="FLASHINFER_MLA")
    parser.add_argument("--enforce-eager", action="store_true")


def engine_kwargs(args) -> dict:
    """SpecPolicyCase fields from the options add_engine_args declared."""
    return dict(device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
                enforce_eager=args.enforce_eager)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


def _with_flags(flags: dict[str, bool | None], fn, *args):
    """fn(*args) with each environment flag set to 1 / 0 as its value says (None: as it is),
    restored afterwards (flags read when the engine is built: engines of other settings can
    live side by side in one process)."""
    before = {flag: os.environ.get(flag) for flag, value in flags.items() if value is not None}
    for flag in before:
        os.environ[flag] = "1" if flags[flag] else "0"
    try:
        return fn(*args)
    finally:
        for flag, value in before.items():
            if value is None:
                os.environ.pop(flag, None)
            else:
                os.environ[flag] = value


def build_engine(case: SpecPolicyCase):
    """The case's engine, with its `batch` greedy requests added (run_case and
    scripts/trace_policy_steps.py share it)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine

    spec = None
    if case.variant != "none":
        spec = {"method": case.method, "num_speculative_tokens": case.num_spec_tokens,
                "disable_by_batch_size": _POLICY[case.variant]}
        if case.draft_model:
            spec["model"] = case.draft_model
    extra = {} if case.device == "cuda" else {"device": case.device}
    engine_args = EngineArgs(
        model=case.model, dtype=case.dtype,
        max_model_len=(case.context + case.prompt_stagger * max(case.batch - 1, 0)
                       + case.output_len + case.num_spec_tokens + 8),
        attention_backend=case.attention_backend, speculative_config=spec,
        max_num_seqs=max(case.batch, 1),
        max_num_batched_tokens=max(4096, case.batch * (case.context + 1)
                                   + case.prompt_stagger * case.batch * case.batch),
        enforce_eager=case.enforce_eager, seed=0, async_scheduling=case.async_scheduling,
        load_format=case.load_format,
        kv_cache_memory_bytes=case.kv_cache_memory_bytes, **extra)
    from vllm.model_executor.layers.attention.mla_context_kv_writer import ENV_FLAG as FUSED
    from vllm.v1.worker.gpu.spec_decode.context_kv_ring import ENV_FLAG as DEFER
    from vllm.v1.worker.gpu.spec_decode.context_refill import ENV_FLAG as REFILL
    engine = _with_flags({DEFER: case.defer_context_kv, FUSED: case.fused_context_kv,
                          REFILL: case.refill_context_kv},
                         LLMEngine.from_engine_args, engine_args)
    try:
        policy = engine.scheduler.spec_policy
        if case.cost_model_config:
            from vllm.v1.spec_decode.cost_model import CostModelConfig, SpeculationCostModel
            config = dataclasses.replace(CostModelConfig(), **dict(case.cost_model_config))
            policy.cost_model = SpeculationCostModel(policy.num_spec_tokens, config)
        if case.variant == "auto-nopay":
            policy.cost_model.acceptance_override = case.forced_acceptance
        if case.early_draft is not None:
            speculator = engine.executor.worker.model_runner.speculator
            if not hasattr(speculator, "set_early_draft_mode"):
                raise ValueError(f"early_draft={case.early_draft!r} needs a block drafter "
                                 f"(DSpark / DFlash), not method={case.method!r}")
            if case.early_draft == "auto-fixed":  # eligible "auto", without its A/B
                speculator.set_early_draft_mode("auto", tune=False)
            else:
                speculator.set_early_draft_mode(case.early_draft)
        params = SamplingParams(temperature=0.0, max_tokens=case.output_len, ignore_eos=True)
        for i in range(case.batch):
            prompt = spec_bench_prompt(i, case.context + i * case.prompt_stagger)
            engine.add_request(f"r{i}", prompt, params)
    except BaseException:
        engine.shutdown()
        raise
    return engine


def run_case(case: SpecPolicyCase, timed_region: Any = None) -> dict:
    """Greedy decode of `batch` requests; tok/s over the steps after the warm-up.
    `timed_region`: a context manager entered around the timed steps only (a diagnostic such
    as host_waits.HostWaits; none by default)."""
    engine = build_engine(case)
    try:
        outputs: dict[str, list[int]] = {}

        def step() -> None:
            for o in engine.step():
                outputs[o.request_id] = list(o.outputs[0].token_ids)

        for _ in range(case.warmup_steps):
            if engine.has_unfinished_requests():
                step()
        tokens_before = engine._num_generation_tokens
        # whether the early draft tuner had decided when the timed steps began ("trial": some
        # timed steps ran its trial; "-": no tuner)
        tuner = early_draft_tuner(engine)
        tuner_at_timing = "-" if tuner is None else tuner.decision(case.batch)
        _sync(case.device)
        pauses = GcPauses()
        with pauses, (timed_region if timed_region is not None else contextlib.nullcontext()):
            start = time.perf_counter()
            timed_steps = 0
            while engine.has_unfinished_requests():
                step()
                timed_steps += 1
            _sync(case.device)
            seconds = time.perf_counter() - start
        tokens = engine._num_generation_tokens - tokens_before
        if tokens == 0:
            raise ValueError(f"{case.variant} B={case.batch}: every token was generated in the "
                             f"{case.warmup_steps} warm-up steps; raise output_len "
                             f"(now {case.output_len}) or lower warmup_steps")
        spec_stats = engine.scheduler.get_stats().get("spec_decode") or {}
        tuner = early_draft_tuner(engine)
        return {"variant": case.variant, "batch": case.batch, "context": case.context,
                # the early draft tuner's finished trials (bucket, late s, early s, early?);
                # its trial (2 x 9 eligible steps, up to 68 on a close call) may reach
                # into the timed steps
                "early_draft_trials": None if tuner is None else list(tuner.history),
                "early_draft_at_timing": tuner_at_timing,
                "tok_s": tokens / seconds,
                "timed_steps": timed_steps, "timed_tokens": tokens,
                # the collector's work inside the timed steps (gc_pauses.py says why)
                "gc_pauses": pauses.summary(), "gc_ms_per_step": pauses.seconds * 1e3 / max(
                    timed_steps, 1),
                "mean_acceptance_length": spec_stats.get("mean_acceptance_length"),
                "num_drafts": spec_stats.get("num_drafts"),
                "policy": spec_stats.get("policy"),
                "tokens": [outputs[f"r{i}"] for i in range(case.batch)]}
    finally:
        engine.shutdown()




def run_rounds(cases: dict[str, SpecPolicyCase], rounds: int, run=None,
               warmup_rounds: int = 0) -> dict[str, list[dict]]:
    """Every case once per round in alternating order, warm-up rounds dropped (rounds.py).
    `run` is run_case (tests pass fakes)."""
    return alternating_rounds(cases, rounds, run or run_case, warmup_rounds)


def paired_ratio(runs: list[dict], base_runs: list[dict]) -> tuple[float, list[float]]:
    """tok/s of `runs` over `base_runs`, paired within rounds (geometric mean, per round)."""
    return paired_tok_ratio([r["tok_s"] for r in runs], [b["tok_s"] for b in base_runs])


def run_interleaved(cases: dict[str, SpecPolicyCase], steps_per_block: int = 16,
                    on_warm=None) -> dict:
    """Every case's engine alive at once, stepped in turn in blocks of `steps_per_block` engine
    steps (the order reversed every other round), after each one's warm-up.

    Why: on the GPU node the same engine's per-step time moves by up to 2x between processes
    and minutes apart (medians 0.47-0.78 ms for one plain B=1 engine, ninth session), far
    more than the 5 % a policy test asks about. Blocks of ~16 ms taken in turn see the same
    machine. Every block is timed whole (device synced at its ends), so probes, exploration
    and stalls count; only blocks of rounds in which every engine still ran a full block are
    kept. Returns {name: {"tok_s": tokens / seconds over the kept blocks, "block_tok_s",
    "blocks", "tokens" (every request's full greedy output), "policy"}} and, under "_rounds",
    the number of kept rounds, and under each name "step_ms": [[ms of each step] per kept
    block] (host wall time of `engine.step()`; a block's time also holds its end sync).
    `on_warm(name, engine)`, if given, is called once per engine after its warm-up (tracing
    hooks, scripts/trace_policy_steps.py)."""
    if steps_per_block < 1:
        raise ValueError(f"steps_per_block={steps_per_block} is invalid: it must be >= 1")
    names = list(cases)
    engines: dict = {}
    try:
        for name in names:
            case = cases[name]
            if case.kv_cache_memory_bytes is None:  # every engine at once on one GPU
                case = dataclasses.replace(case, kv_cache_memory_bytes=1 << 30)
            engines[name] = build_engine(case)
        outputs: dict[str, dict[str, list[int]]] = {name: {} for name in names}

        def step(name: str) -> None:
            for o in engines[name].step():
                outputs[name][o.request_id] = list(o.outputs[0].token_ids)

        for name in names:
            for _ in range(cases[name].warmup_steps):
                if engines[name].has_unfinished_requests():
                    step(name)
        if on_warm is not None:
            for name in names:
                on_warm(name, engines[name])
        blocks: dict[str, list[tuple[int, float]]] = {name: [] for name in names}
        step_ms: dict[str, list[list[float]]] = {name: [] for name in names}
        clock = time.perf_counter
        order = names
        while True:
            round_blocks, round_steps, full = {}, {}, True
            for name in order:
                engine, device = engines[name], cases[name].device
                before, done, ms = engine._num_generation_tokens, 0, []
                _sync(device)
                start = clock()
                while done < steps_per_block and engine.has_unfinished_requests():
                    t0 = clock()
                    step(name)
                    ms.append((clock() - t0) * 1e3)
                    done += 1
                _sync(device)
                round_blocks[name] = (engine._num_generation_tokens - before, clock() - start)
                round_steps[name] = ms
                full &= done == steps_per_block
            if not full:
                break
            for name in names:
                blocks[name].append(round_blocks[name])
                step_ms[name].append(round_steps[name])
            order = order[::-1]
        if not blocks[names[0]]:
            raise ValueError(f"no full round of {steps_per_block}-step blocks after the warm-up: "
                             "raise output_len or lower steps_per_block / warmup_steps")
        for name in names:  # the rest untimed, for the full outputs
            while engines[name].has_unfinished_requests():
                step(name)
        result: dict = {"_rounds": len(blocks[names[0]])}
        for name in names:
            case = cases[name]
            spec_stats = engines[name].scheduler.get_stats().get("spec_decode") or {}
            tokens = sum(t for t, _ in blocks[name])
            seconds = sum(s for _, s in blocks[name])
            result[name] = {
                "variant": case.variant, "batch": case.batch, "tok_s": tokens / seconds,
                "block_tok_s": [t / s for t, s in blocks[name]], "blocks": blocks[name],
                "step_ms": step_ms[name],
                "policy": spec_stats.get("policy"),
                "mean_acceptance_length": spec_stats.get("mean_acceptance_length"),
                "tokens": [outputs[name][f"r{i}"] for i in range(case.batch)]}
        return result
    finally:
        for engine in engines.values():
            engine.shutdown()
