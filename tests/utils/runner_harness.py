"""Drive GPUModelRunner directly with a minimal scheduler loop, and compute the greedy oracle.

The loop admits requests at chosen steps (so prefills and decodes share batches), allocates
virtual blocks from a counter exactly as the contract says (num_computed + num_scheduled +
k + 1 tokens), and schedules either the runner's own drafts ("natural") or scripted drafts built
from the oracle continuation with a planted mismatch ("forced": exactly `a` drafts accepted).

The oracle is plain greedy decoding without any paged cache: every token comes from a full
causal forward of the whole sequence (no forward context, so no KV cache, no DCP, no drafts).
"""
from __future__ import annotations

import os
import pickle
import socket
from dataclasses import dataclass, field

import torch

from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig
from vllm.v1.core.kv_cache_utils import get_kv_cache_config
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.worker.gpu.model_runner import GPUModelRunner
from vllm.forward_context import dense_attention_context

BLOCK_SIZE = 16
NUM_BLOCKS = 96


@dataclass
class Scenario:
    name: str
    prompts: dict[str, list[int]]
    max_new_tokens: int
    arrival_step: dict[str, int] = field(default_factory=dict)  # default 0
    # Forced mode: req_id -> drafts to accept at its 1st, 2nd, ... verification (then natural);
    # a negative value means "all k".
    forced_accepts: dict[str, list[int]] | None = None
    sampling_params: dict = field(default_factory=dict)  # req_id -> SamplingParams (else greedy)
    # Chunked prefill: at most this many prompt tokens per request and step (None: whole).
    prefill_chunk: int | None = None
    # Steps after which nobody drafts (the scheduler output's propose_drafts=False, as a
    # speculation policy sets it): the next step verifies no drafts.
    pause_steps: frozenset = frozenset()


@dataclass
class ScenarioResult:
    outputs: dict[str, list[int]]
    proposals: dict[str, list[list[int]]]      # drafts the runner proposed, per step
    accepted: dict[str, list[int]]             # accepted drafts per verification
    drafted: dict[str, list[int]]              # drafts verified per verification
    draft_logits: list[torch.Tensor] = field(default_factory=list)  # every drafter logits call
    # req_id -> the request's whole token sequence (prompt + every sampled token) at each proposal
    histories: dict[str, list[list[int]]] = field(default_factory=dict)
    num_dcp_decode_builds: int = 0     # decode metadata built under DCP (target and draft)
    local_len_mismatches: list[str] = field(default_factory=list)
    # (group_id, causal, global seq_lens, rank-local seq_lens, query lens) of every DCP decode
    # build, in build order.
    decode_builds: list[tuple] = field(default_factory=list)
    num_partial_prefill_rows: int = 0  # rows that ran a prefill chunk short of the prompt end
    # (layer names, dcp_sharded, pages of each layer's cache) of every KV cache group
    kv_groups: list[tuple[list[str], bool, int]] = field(default_factory=list)
    # the runner's (refill passes, tokens refilled) (context_refill.py)
    context_refills: tuple[int, int] = (0, 0)


def make_config(model_dir: str, method: str | None = None, draft_dir: str | None = None,
                k: int = 3, dcp: int = 1, interleave: int = 1, backend: str = "TORCH_MLA",
                device: str = "cpu", dtype: str = "float32", max_model_len: int = 256,
                draft_dcp: int | None = None, disable_by_batch_size=None):
    spec = None
    if method is not None:
        # "<method>+prob": probabilistic drafts verified by probabilistic rejection sampling.
        method, _, variant = method.partition("+")
        sampling = "probabilistic" if variant == "prob" else None
        spec = SpeculativeConfig(method=method, model=draft_dir, num_speculative_tokens=k,
                                 draft_sample_method=sampling or "greedy",
                                 rejection_sample_method=sampling or "strict",
                                 draft_decode_context_parallel_size=draft_dcp,
                                 disable_by_batch_size=disable_by_batch_size)
    return VllmConfig(
        model_config=ModelConfig(model=model_dir, dtype=dtype, max_model_len=max_model_len,
                                 attention_backend=backend, device=device),
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        parallel_config=ParallelConfig(tensor_parallel_size=dcp, decode_context_parallel_size=dcp,
                                       cp_kv_cache_interleave_size=interleave),
        speculative_config=spec, max_num_seqs=8, max_num_batched_tokens=512)


def make_runner(vllm_config, device: str = "cpu", rank: int = 0) -> GPUModelRunner:
    runner = GPUModelRunner(vllm_config, torch.device(device), rank)
    runner.load_model()
    runner.initialize_kv_cache(get_kv_cache_config(runner.get_kv_cache_spec(),
                                                   num_blocks=NUM_BLOCKS,
                                                   dcp_size=runner.dcp_size))
    return runner


def run_scenario(runner: GPUModelRunner, scenario: Scenario,
                 oracle: dict[str, list[int]] | None = None,
                 record_draft_logits: bool = True) -> ScenarioResult:
    """Run to completion; `oracle` (greedy continuations) is needed for forced drafts.
    record_draft_logits copies every drafter logits call to the host (a sync per call: off for
    the sync-budget test)."""
    k = runner.num_spec_tokens
    dcp = runner.dcp_size
    virtual_block = BLOCK_SIZE * dcp
    next_block = 0
    pending = dict(scenario.prompts)
    running: dict[str, dict] = {}
    result = ScenarioResult({r: [] for r in pending}, {r: [] for r in pending},
                            {r: [] for r in pending}, {r: [] for r in pending})
    finished: set[str] = set()
    step = 0
    if runner.speculator is not None and record_draft_logits:
        _record_draft_logits(runner.speculator.model, result.draft_logits)
    for group in runner.kv_cache_config.kv_cache_groups:
        result.kv_groups.append((list(group.layer_names),
                                 bool(getattr(group.kv_cache_spec, "dcp_sharded", True)),
                                 int(runner.kv_caches[group.layer_names[0]].shape[0])))
    _check_local_lengths(runner, result)
    while pending or running:
        new_reqs, cached = [], CachedRequestData()
        num_scheduled: dict[str, int] = {}
        spec_tokens: dict[str, list[int]] = {}

        def allocate(state, tokens_needed):
            nonlocal next_block
            need = -(-tokens_needed // virtual_block) - len(state["blocks"])
            ids = list(range(next_block, next_block + max(need, 0)))
            next_block += len(ids)
            if next_block > NUM_BLOCKS:
                raise RuntimeError("harness ran out of KV blocks; raise NUM_BLOCKS")
            state["blocks"].extend(ids)
            return ids

        for req_id, state in running.items():
            remaining = len(state["tokens"]) - state["num_computed"]
            if remaining > 1:  # chunked prefill in progress: its next chunk, no drafts
                count = min(remaining, scenario.prefill_chunk)
                new_ids = allocate(state, state["num_computed"] + count + k + 1)
                cached.req_ids.append(req_id)
                cached.new_block_ids.append(new_ids)
                cached.num_computed_tokens.append(state["num_computed"])
                num_scheduled[req_id] = count
                continue
            drafts = state["drafts"]
            forced = (scenario.forced_accepts or {}).get(req_id, [])
            verification = len(result.accepted[req_id])
            if drafts and verification < len(forced):
                accept = k if forced[verification] < 0 else forced[verification]
                drafts = _forced_drafts(oracle[req_id], state["num_generated"], k, accept)
            # Drafts never run past max_model_len (like the real scheduler).
            room = runner.max_model_len - (state["num_computed"] + 1)
            drafts = drafts[:max(room, 0)]
            count = 1 + len(drafts)
            new_ids = allocate(state, state["num_computed"] + count + k + 1)
            cached.req_ids.append(req_id)
            cached.new_block_ids.append(new_ids)
            cached.num_computed_tokens.append(state["num_computed"])
            num_scheduled[req_id] = count
            if drafts:
                spec_tokens[req_id] = drafts
        for req_id in [r for r in pending if scenario.arrival_step.get(r, 0) <= step]:
            prompt = pending.pop(req_id)
            state = {"num_computed": 0, "blocks": [], "drafts": [], "num_generated": 0,
                     "tokens": list(prompt)}
            count = len(prompt) if scenario.prefill_chunk is None else min(
                len(prompt), scenario.prefill_chunk)
            ids = allocate(state, count + k + 1)
            new_reqs.append(NewRequestData(req_id, list(prompt), ids, 0,
                                           scenario.sampling_params.get(req_id)))
            num_scheduled[req_id] = count
            running[req_id] = state
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            scheduled_spec_decode_tokens=spec_tokens, finished_req_ids=finished,
            propose_drafts=step not in scenario.pause_steps)
        finished = set()
        out = runner.execute_model(output)
        # The drafts stay on the device in the engine (the output carries placeholders); the
        # harness reads them back explicitly to compare proposals.
        proposed = runner.take_draft_token_ids() if out.spec_token_ids is not None else {}
        for i, req_id in enumerate(out.req_ids):
            state = running[req_id]
            tokens = out.sampled_token_ids[i]
            if spec_tokens.get(req_id):
                result.accepted[req_id].append(out.num_accepted_tokens[i])
                result.drafted[req_id].append(out.num_draft_tokens[i])
            state["num_computed"] += num_scheduled[req_id] - (
                out.num_draft_tokens[i] - out.num_accepted_tokens[i])
            result.outputs[req_id].extend(tokens)
            state["num_generated"] += len(tokens)
            state["tokens"].extend(tokens)
            if not tokens:  # an unfinished chunked prefill: no sample, no drafts
                assert out.spec_token_ids is None or out.spec_token_ids[i] == [], req_id
                result.num_partial_prefill_rows += 1
                continue
            if out.spec_token_ids is not None and not output.propose_drafts:
                assert out.spec_token_ids[i] == [], req_id  # no draft pass after this step
                state["drafts"] = []
            elif out.spec_token_ids is not None:
                assert len(out.spec_token_ids[i]) == k
                state["drafts"] = list(out.spec_token_ids[i])  # placeholders: device drafts
                result.proposals[req_id].append(list(proposed[req_id]))
                result.histories.setdefault(req_id, []).append(list(state["tokens"]))
            if len(result.outputs[req_id]) >= scenario.max_new_tokens:
                result.outputs[req_id] = result.outputs[req_id][: scenario.max_new_tokens]
                del running[req_id]
                finished.add(req_id)
        step += 1
    if finished:  # let the runner drop the last finished requests
        runner.execute_model(SchedulerOutput(
            scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(),
            num_scheduled_tokens={}, total_num_scheduled_tokens=0, finished_req_ids=finished))
    return result


def _record_draft_logits(draft_model, log: list[torch.Tensor]) -> None:
    # Compare drafter numerics across DCP sizes: tokens alone hide small metadata errors.
    original = type(draft_model).compute_logits

    def recording(hidden):
        logits = original(draft_model, hidden)
        log.append(logits.detach().float().cpu())
        return logits

    draft_model.compute_logits = recording


def _check_local_lengths(runner: GPUModelRunner, result: ScenarioResult) -> None:
    """Every decode metadata built under DCP must hand the kernel rank-local lengths that match
    its global lengths (kernels such as FlashInfer's sm100 path read them directly)."""
    from vllm.v1.worker.gpu.cp_utils import get_dcp_local_seq_lens
    if runner.dcp_size == 1:
        return
    for group_id, builder in enumerate(runner.attn_metadata_builders):
        if getattr(builder, "dcp_world_size", runner.dcp_size) == 1:
            continue  # a replicated group: global lengths, nothing rank-local to check
        original = builder.build

        def checked(common_prefix_len, common_attn_metadata, _original=original, _g=group_id):
            metadata = _original(common_prefix_len, common_attn_metadata)
            decode = metadata.decode
            if decode is not None:
                result.num_dcp_decode_builds += 1
                qsl = decode.query_start_loc_cpu.tolist()
                result.decode_builds.append((_g, bool(decode.causal),
                                             decode.dcp_tot_seq_lens.tolist(),
                                             decode.seq_lens.tolist(),
                                             [e - s for s, e in zip(qsl[:-1], qsl[1:])]))
                expected = get_dcp_local_seq_lens(decode.dcp_tot_seq_lens, runner.dcp_size,
                                                  runner.dcp_rank, runner.dcp_interleave)
                if decode.seq_lens.tolist() != expected.tolist():
                    result.local_len_mismatches.append(
                        f"group {_g}: local {decode.seq_lens.tolist()} for global "
                        f"{decode.dcp_tot_seq_lens.tolist()}, expected {expected.tolist()}")
            return metadata

        builder.build = checked


def _forced_drafts(continuation: list[int], num_generated: int, k: int, accept: int) -> list[int]:
    """k drafts for the next positions: the oracle's tokens with a wrong one at index `accept`."""
    truth = continuation[num_generated: num_generated + k]
    drafts = list(truth) + [0] * (k - len(truth))
    if accept < k:
        drafts[accept] = (drafts[accept] + 1) % 256
    return drafts


@torch.inference_mode()
def greedy_oracle(model, prompts: dict[str, list[int]], max_new_tokens: int,
                  margins: dict[str, list[float]] | None = None) -> dict[str, list[int]]:
    """Plain greedy decoding by full recomputation (no paged cache, no forward context).
    `margins`, if given, receives each step's top-1 minus top-2 logit gap."""
    device = next(model.parameters()).device
    out = {}
    for req_id, prompt in prompts.items():
        tokens = list(prompt)
        for _ in range(max_new_tokens):
            ids = torch.tensor(tokens, dtype=torch.int64, device=device)
            with dense_attention_context():
                hidden = model(ids, torch.arange(len(tokens), device=device))
            logits = model.compute_logits(hidden[-1:]).float()[0]
            if margins is not None:
                top2 = logits.topk(2).values
                margins.setdefault(req_id, []).append(float(top2[0] - top2[1]))
            tokens.append(int(logits.argmax()))
        out[req_id] = tokens[len(prompt):]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_dist(rank: int, world_size: int, port: int, dcp: int, backend: str = "gloo") -> None:
    from vllm.distributed.parallel_state import (init_distributed_environment,
                                                 initialize_model_parallel)
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    init_distributed_environment(world_size, rank, backend=backend,
                                 init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(tensor_parallel_size=world_size, decode_context_parallel_size=dcp)


# ------------------------------------------------------------------ multi-process worlds
def spec_tag(method: str | None, draft_dcp: int | None = None, refill: bool = False) -> str:
    """Result key of a case: the method, plus "@draft_dcp<n>" when the drafter's DCP size is
    set explicitly, plus "+refill" for a refilled drafter context."""
    tag = method or "plain"
    tag = tag if draft_dcp is None else f"{tag}@draft_dcp{draft_dcp}"
    return f"{tag}+refill" if refill else tag


def run_all_methods(paths: dict[str, str], cases: list[tuple[str | None, int]], scenario: Scenario,
                    oracle: dict[str, list[int]], *, dcp: int = 1, interleave: int = 1,
                    rank: int = 0, backend: str = "TORCH_MLA", device: str = "cpu",
                    dtype: str = "float32") -> dict[str, ScenarioResult]:
    """One runner per (method, k), (method, k, draft_dcp) or (method, k, draft_dcp, "refill")
    on this rank; results keyed by spec_tag (a method may carry a "+prob" variant suffix).
    "refill": VLLM_DRAFT_CONTEXT_REFILL=1 with a policy set, so the scenario's pause steps
    skip the block drafter's context write and the next draft pass refills it."""
    import os

    from vllm.v1.worker.gpu.spec_decode.context_refill import ENV_FLAG as REFILL
    results = {}
    for method, k, *rest in cases:
        draft_dcp = rest[0] if rest else None
        refill = len(rest) > 1 and rest[1] == "refill"
        draft_dir = paths.get(method.partition("+")[0]) if method else None
        config = make_config(paths["target"], method, draft_dir, k=k, dcp=dcp,
                             interleave=interleave, backend=backend, device=device, dtype=dtype,
                             draft_dcp=draft_dcp,
                             disable_by_batch_size="auto" if refill else None)
        before = os.environ.get(REFILL)
        os.environ[REFILL] = "1" if refill else "0"  # read when the KV cache is set up
        try:
            runner = make_runner(config, device=device, rank=rank)
        finally:
            os.environ.pop(REFILL) if before is None else os.environ.update({REFILL: before})
        result = run_scenario(runner, scenario, oracle)
        result.context_refills = (runner.context_refills, runner.context_refill_tokens)
        results[spec_tag(method, draft_dcp, refill)] = result
    return results


def run_stale_control(paths, method: str, k: int, scenario: Scenario, oracle, *, dcp: int,
                      interleave: int, rank: int, mode: str = "target",
                      **options) -> ScenarioResult:
    """Negative controls of the shared draft builder's recompute (the patch set's first
    behaviour). mode "target": the draft metadata gets the TARGET's (stale) rank-local lengths.
    mode "removed": the recompute is removed (the call does nothing, the draft's persistent
    buffer keeps whatever an earlier forward left). Output must stay exact (verification), but
    the drafts must change, which shows the recompute is load-bearing."""
    from vllm.v1.worker.gpu.spec_decode import speculator as speculator_module
    config = make_config(paths["target"], method, paths[method], k=k, dcp=dcp,
                         interleave=interleave, **options)
    runner = make_runner(config, device=options.get("device", "cpu"), rank=rank)
    real = speculator_module.prepare_dcp_local_seq_lens

    def stale(out, seq_lens, num_reqs, cp_size, cp_rank, cp_interleave):
        if mode == "target":
            real(out, runner.input_buffers.seq_lens, num_reqs, cp_size, cp_rank, cp_interleave)
        elif mode != "removed":
            raise ValueError(f"unknown control mode {mode!r}")

    speculator_module.prepare_dcp_local_seq_lens = stale
    try:
        return run_scenario(runner, scenario, oracle)
    finally:
        speculator_module.prepare_dcp_local_seq_lens = real


def dcp_world_main(rank: int, world_size: int, port: int, interleave: int, paths, cases,
                   scenario, oracle, stale_cases, queue, gpu: bool = False) -> None:
    """Entry point of one spawned rank (TP = DCP = world_size); rank 0 reports.
    gpu=True: NCCL, cuda:rank, FLASHINFER_MLA, bfloat16; else gloo, CPU, TORCH_MLA, float32."""
    try:
        options = {}
        if gpu:
            torch.cuda.set_device(rank)
            options = dict(backend="FLASHINFER_MLA", device=f"cuda:{rank}", dtype="bfloat16")
        init_dist(rank, world_size, port, dcp=world_size, backend="nccl" if gpu else "gloo")
        results = run_all_methods(paths, cases, scenario, oracle, dcp=world_size,
                                  interleave=interleave, rank=rank, **options)
        stale = {}
        for case in stale_cases:
            m, k, mode = (*case, "target")[:3]
            key = m if mode == "target" else f"{m}:{mode}"
            stale[key] = run_stale_control(paths, m, k, scenario, oracle, dcp=world_size,
                                           interleave=interleave, rank=rank, mode=mode,
                                           **options)
        if rank == 0:
            # Plain pickle bytes: tensors sent through a Queue would live in shared memory that
            # vanishes when this process exits.
            queue.put(("ok", pickle.dumps((results, stale)), None))
    except BaseException:  # report instead of hanging the parent
        import traceback
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}", None))
        raise
    finally:
        from vllm.distributed.parallel_state import (destroy_distributed_environment,
                                                     destroy_model_parallel)
        destroy_model_parallel()
        destroy_distributed_environment()


def spawn_world(target, world_size: int, args_of_rank, label: str, timeout_s: float = 300.0):
    """Start `world_size` spawned processes running target(*args_of_rank(rank, port, queue)) and
    return the unpickled payload that rank 0 puts on the queue as ("ok", pickled, ...); a rank's
    ("error", text, ...) is raised as RuntimeError(text)."""
    import multiprocessing as mp
    import queue as queue_module
    ctx = mp.get_context("spawn")
    results_queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=tuple(args_of_rank(r, port, results_queue)),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        message = results_queue.get(timeout=timeout_s)
    except queue_module.Empty:
        raise RuntimeError(f"DCP={world_size} {label} produced no result in {timeout_s}s") \
            from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    status, payload = message[0], message[1]
    if status != "ok":
        raise RuntimeError(payload)
    return pickle.loads(payload)


def spawn_dcp_world(world_size: int, interleave: int, paths, cases, scenario, oracle,
                    stale_cases=(), timeout_s: float = 300.0, gpu: bool = False):
    return spawn_world(
        dcp_world_main, world_size,
        lambda r, port, q: (r, world_size, port, interleave, paths, cases, scenario, oracle,
                            list(stale_cases), q, gpu),
        "world", timeout_s)
