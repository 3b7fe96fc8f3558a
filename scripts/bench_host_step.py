"""Host cost of a steady decode step's input and metadata builders, measured on the CPU.

Builds the runner's pieces on device="cpu" (RequestStates, BlockTables, InputBatchBuilder, the
MLA metadata builder of TORCH_MLA) and times, with the thread clock (`--clock wall`: perf_counter;
median of --repeats steps):

  * `build`    InputBatchBuilder.build of a steady decode (or uniform verify) layout;
  * `attn`     build_attn_metadata with the runner's arguments (one KV cache group);
  * `csr`      plan_hopper_decode on that step's decode metadata into a graph-sized PlanStaging
               ring (the FlashInfer builder's host CSR plan; pure numpy, runs without CUDA);
  * `fi`       the FLASHINFER_MLA (Hopper) builder's whole build of the same step (graph
               wrapper): the common MLA build, the CSR plan and the plan refresh, with FlashInfer
               replaced by a stand-in whose native planner is the planner model of the tests
               (tests/utils/flashinfer_mla_plan_model.py), so steady steps refresh the held plan
               as on the GPU, and a real plan is made when a request's chunk count changes
               (FlashInfer is not importable here; the model's own time is taken out, as the
               C++ planner's ~0.2 ms on an H200 node is in no number; at Q=1 the median step is
               a refresh, and so is a causal verify step whose rows are one query tile each);
  * `total`    build + attn + csr;
  * the ATen ops (and copy_ ops) one step dispatches, views excluded (each one costs a CUDA host
    ~5-10 us, which the CPU run hides), for build alone and for the whole step; "device launches"
    adds the stubbed single-launch kernels (below) to the ATen ops: what a CUDA host launches;
    the FlashInfer build's own ops ("stubbed kernels": single-launch kernels that --host-only
    replaced, one launch each on CUDA), and the FlashInfer refreshes / real plans over the run;
  * the ATen ops of the block appends between steps (BlockTables.append_block_ids, called by
    the runner's _update_states), per step;
  * `FI advance instead`: FlashInferMLAMetadataBuilder.advance_decode_plan_on_device of the
    previous step's metadata to this step's lengths (what the early draft step does instead
    of a build where the held plan's pages and chunk counts still hold; on the CPU its device
    write is the torch form, one Triton launch on CUDA), median over the steps where it held.

Every timed step is a real next step: each request's num_computed grows by the query length and
a block is appended when the sequence crosses a block boundary (outside the timed region), so
skip-if-unchanged caches see the same invalidations as in the engine.

A CPU device hides GPU launch costs but shows the Python/numpy costs. Some work that is a single
Triton launch on CUDA runs as a dozen torch ops on the CPU (the device-side preparation of the
inputs, the slot mappings, the decode row geometry); `--host-only` (default on) replaces those
three with no-ops, so the numbers are the host work that a CUDA run also does (minus the launch
cost of those three kernels). `--no-host-only` times the full CPU path.

    PYTHONPATH=. OMP_NUM_THREADS=1 python scripts/bench_host_step.py [--batch-sizes 1 8 32 64]
        [--q 1 4] [--repeats 300] [--ctx 1024] [--block-size 16] [--no-host-only]
"""
from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

import numpy as np

import torch


# thread CPU time by default (--clock): the box is shared, and wall time counts the other
# processes.
_clock = time.thread_time

# Calls of the stubbed single-launch kernels (each is one CUDA launch on a GPU host): in all,
# and per function name.
STUB_LAUNCHES = [0]
STUB_CALLS: dict[str, int] = {}

# time spent in the stand-in's planner model (taken out of `fi`)
PLANNER_TIME = [0.0]


def _counted_noop(name: str):
    def noop(self, *args, **kwargs):
        STUB_LAUNCHES[0] += 1
        STUB_CALLS[name] = STUB_CALLS.get(name, 0) + 1
    return noop


@contextmanager
def _stub_device_prep(enabled: bool):
    """Replace the CPU torch fallbacks of single-launch CUDA kernels by no-ops (counted)."""
    if not enabled:
        yield
        return
    from vllm.v1.attention.backends.mla import common as mla_common
    from vllm.v1.worker.gpu import block_table, input_batch
    saved = [(input_batch.InputBatchBuilder, "_prepare_torch"),
             (block_table.BlockTables, "_compute_slot_mappings_torch"),
             (mla_common.MLACommonMetadataBuilder, "_row_seq_lens_torch")]
    originals = [getattr(owner, name, None) for owner, name in saved]
    for owner, name in saved:
        setattr(owner, name, _counted_noop(name))
    if originals[2] is None:  # a tree from before _row_seq_lens_torch: stub the whole method
        def row_seq_lens_stub(self, cm, num_decodes, num_tokens, causal, local_seq_lens):
            STUB_LAUNCHES[0] += 1
            out, req, pos = self._row_buffers(num_tokens, cm.seq_lens.device)
            return out[:num_tokens], req[:num_tokens], pos[:num_tokens]

        originals.append(mla_common.MLACommonMetadataBuilder._row_seq_lens)
        saved.append((mla_common.MLACommonMetadataBuilder, "_row_seq_lens"))
        mla_common.MLACommonMetadataBuilder._row_seq_lens = row_seq_lens_stub
    try:
        yield
    finally:
        for (owner, name), original in zip(saved, originals):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def _install_fake_flashinfer() -> None:
    """A stand-in flashinfer (tests/utils/fake_flashinfer.py): wrappers whose first plan()
    leaves the fa3 backend layout that _native_replan drives, with the planner model as the
    native planner (its own time counted in PLANNER_TIME and taken out of the `fi` number, as
    the C++ planner's is not in it either) and the workload check stubbed."""
    import pytest

    from tests.utils.fake_flashinfer import PlanModelWrapper, install_native_replan, \
        plan_model_native

    def timed_native(*args):
        start = _clock()
        try:
            return plan_model_native(*args)
        finally:
            PLANNER_TIME[0] += _clock() - start

    class Wrapper(PlanModelWrapper):
        native = staticmethod(timed_native)

    install_native_replan(pytest.MonkeyPatch(), Wrapper)


def _setup(batch: int, q: int, ctx: int, block_size: int, max_reqs: int, max_model_len: int):
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig
    from vllm.v1.attention.backends.mla.flashinfer_mla import PlanStaging, max_plan_requests
    from vllm.v1.attention.backends.mla.torch_mla import TorchMLAMetadataBuilder
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MLAAttentionSpec
    from vllm.v1.worker.gpu.block_table import BlockTables
    from vllm.v1.worker.gpu.input_batch import InputBatchBuilder
    from vllm.v1.worker.gpu.request_states import RequestStates

    k = q - 1
    max_blocks = -(-max_model_len // block_size)
    max_tokens = max_reqs * q
    states = RequestStates(max_reqs, "cpu", k)
    tables = BlockTables([block_size], max_reqs, max_blocks, max(max_tokens, 2048), "cpu")
    next_block = [1]
    rows = []
    for i in range(batch):
        length = ctx + 7 * i  # staggered lengths: rows cross block boundaries on different steps
        state = states.add(f"r{i}", [0] * (length + 1), length, None)
        nb = -(-(length + q) // block_size)
        tables.append_block_ids(state.slot, (list(range(next_block[0], next_block[0] + nb)),),
                                overwrite=True)
        next_block[0] += nb
        rows.append(state)
    builder = InputBatchBuilder(max_reqs, max_tokens, torch.device("cpu"), k)
    spec = MLAAttentionSpec(block_size=block_size, dtype=torch.bfloat16)
    cfg = VllmConfig(parallel_config=ParallelConfig())
    try:
        cfg.model_config = ModelConfig(max_model_len=max_model_len)
    except Exception:  # noqa: BLE001 - the staging size only needs max_model_len
        pass
    mla = TorchMLAMetadataBuilder(spec, ["layer0"], cfg, "cpu", dcp_rank=0)
    mla.reorder_batch_threshold = q

    class _Cfg:  # what build_attn_metadata reads of the KV cache config
        kv_cache_groups = [KVCacheGroupSpec(["layer0"], spec)]

    from types import SimpleNamespace

    from vllm.v1.attention.backends.mla import flashinfer_mla
    fi_cfg = SimpleNamespace(parallel_config=ParallelConfig(), max_num_seqs=max_reqs,
                             model_config=SimpleNamespace(max_model_len=max_model_len))
    _install_fake_flashinfer()
    fi = flashinfer_mla.FlashInferMLAMetadataBuilder(spec, ["layer0"], fi_cfg, "cpu",
                                                     dcp_rank=0, kernel_family="hopper",
                                                     workspace_bytes=1 << 12)
    fi.reorder_batch_threshold = q
    pages = max_plan_requests(batch, q, 1) * (max_blocks + 1)
    staging = PlanStaging(max_plan_requests(batch, q, 1), pages, depth=2)
    return dict(states=states, tables=tables, rows=rows, builder=builder, mla=mla, fi=fi,
                cfg=_Cfg(),
                staging=staging, next_block=next_block, block_size=block_size, q=q,
                max_model_len=max_model_len)


def _advance(env) -> None:
    """The next steady step: every request computed q more tokens; append blocks as needed."""
    states, tables, q, bs = env["states"], env["tables"], env["q"], env["block_size"]
    for state in env["rows"]:
        new = state.num_computed_tokens + q
        states.set_num_computed(state, new)
        have = int(tables.num_blocks[0, state.slot])
        need = -(-(new + q) // bs)
        if need > have:
            ids = list(range(env["next_block"][0], env["next_block"][0] + need - have))
            env["next_block"][0] += need - have
            tables.append_block_ids(state.slot, (ids,), overwrite=False)


def _step(env, timings, counter=None, fi_counter=None) -> None:
    from vllm.v1.attention.backends.mla.flashinfer_mla import plan_hopper_decode
    from vllm.v1.worker.gpu.attn_utils import build_attn_metadata
    rows, q = env["rows"], env["q"]
    B = len(rows)
    counts, drafts, samples, host_ids = [q] * B, [q - 1] * B, [True] * B, [None] * B
    t0 = _clock()
    batch = env["builder"].build(rows, counts, drafts, samples, host_ids, env["states"],
                                 env["tables"], num_reqs_padded=B, num_tokens_padded=B * q)
    batch.cudagraph = True
    t1 = _clock()
    if counter is not None:  # what build alone dispatched
        counter.build_ops = sum(counter.counts.values())
        counter.build_copies = counter.counts.get("copy_", 0)
        counter.build_launches = counter.build_ops + STUB_LAUNCHES[0]
    # The runner's call (model_runner._build_batch), graph step.
    md = build_attn_metadata(
        attn_metadata_builders=[env["mla"]], kv_cache_config=env["cfg"],
        num_reqs=batch.num_reqs_padded, num_tokens=batch.num_tokens_padded,
        query_start_loc=batch.query_start_loc, query_start_loc_cpu=batch.query_start_loc_cpu,
        seq_lens=env["builder"].buffers.seq_lens, max_query_len=q,
        max_seq_len=env["max_model_len"], block_tables=batch.block_tables,
        slot_mappings=batch.slot_mappings, causal=True, dcp_local_seq_lens=None,
        seq_lens_cpu_upper_bound=torch.from_numpy(batch.seq_lens_np.copy()),
        seq_lens_cpu=torch.from_numpy(batch.seq_lens_np.copy()), dcp_local_seq_lens_cpu=None,
        block_tables_cpu=env["tables"].input_block_tables_cpu, cudagraph=True)
    t2 = _clock()
    decode = md["layer0"].decode
    plan_hopper_decode(decode, env["block_size"], "auto", num_requests=B,
                       staging=env["staging"])
    t3 = _clock()
    # The FlashInfer builder on the same step (graph step: its plan runs at build time once a
    # first plan recorded the layer arguments).
    common = _common_of(env, batch, q)
    stubbed = sum(STUB_CALLS.values())
    planner_before = PLANNER_TIME[0]
    prev = env.get("fi_md")
    if prev is not None and "advance" in timings:
        # What the early draft step's advance costs instead of this build where the previous
        # step's plan still holds (same pages, chunk counts): the lengths are exact here, so
        # both bounds are this step's lengths.
        lens = np.asarray(batch.seq_lens_np[:B], dtype=np.int64)
        ta = _clock()
        held = env["fi"].advance_decode_plan_on_device(prev, (lens, lens))
        tb = _clock()
        env["advances"] = env.get("advances", 0) + int(held)
        if held:
            timings["advance"].append(tb - ta)
    t4 = _clock()
    if fi_counter is None:
        fi_md = env["fi"].build(0, common)
    else:
        with fi_counter.mode:
            fi_md = env["fi"].build(0, common)
    t5 = _clock()
    if fi_counter is not None:  # single-launch kernels the host-only run stubbed
        fi_counter.counts["stubbed kernels"] = sum(STUB_CALLS.values()) - stubbed
    state = fi_md.decode.backend_state
    if state.wrapper_slot.plan_args is None:  # the first layer's plan (what a forward does)
        from vllm.v1.attention.backends.mla.flashinfer_mla import _plan
        _plan(state.wrapper_slot, state.hopper_inputs, ("first",), num_heads=16,
              head_dim_ckv=512, head_dim_kpe=64, page_size=env["block_size"], sm_scale=0.1,
              q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, lse_mode="basee")
    env["fi_md"] = fi_md
    timings["fi"].append(t5 - t4 - (PLANNER_TIME[0] - planner_before))
    timings["build"].append(t1 - t0)
    timings["attn"].append(t2 - t1)
    timings["csr"].append(t3 - t2)
    timings["total"].append(t3 - t0)


class _OpCounter:
    """Counts the ATen ops one step dispatches (views excluded): on a CUDA host each op on a
    device tensor costs ~5-10 us, each non-blocking copy launch ~5 us, which a CPU run hides."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self.counts = {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                schema = func._schema
                is_view = any(a.alias_info is not None and not a.alias_info.is_write
                              for a in schema.returns)
                if not is_view:
                    name = func.overloadpacket.__name__
                    counts[name] = counts.get(name, 0) + 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()


def _common_of(env, batch, q):
    from vllm.v1.attention.backend import CommonAttentionMetadata
    b, tables = batch, env["tables"]
    return CommonAttentionMetadata(
        query_start_loc=b.query_start_loc, query_start_loc_cpu=b.query_start_loc_cpu,
        seq_lens=b.seq_lens, num_reqs=b.num_reqs_padded, num_actual_tokens=b.num_tokens_padded,
        max_query_len=q, max_seq_len=env["max_model_len"], block_table_tensor=b.block_tables[0],
        slot_mapping=b.slot_mappings[0], seq_lens_cpu=torch.from_numpy(b.seq_lens_np.copy()),
        block_table_cpu=tables.input_block_tables_cpu[0][: b.num_reqs_padded], cudagraph=True)


def bench(batch: int, q: int, args) -> dict[str, float]:
    env = _setup(batch, q, args.ctx, args.block_size, max(args.batch_sizes) * 2,
                 args.max_model_len)
    timings = {name: [] for name in ("build", "attn", "csr", "fi", "total", "advance")}
    with _stub_device_prep(args.host_only), torch.inference_mode():
        for _ in range(args.warmup):
            _advance(env)
            _step(env, {name: [] for name in timings if name != "advance"})
        env["advances"] = 0
        for _ in range(args.repeats):
            _advance(env)
            _step(env, timings)
        advances = env["advances"]
        counter = _OpCounter()
        _advance(env)
        STUB_LAUNCHES[0] = 0
        with counter.mode:
            _step(env, {name: [] for name in timings if name != "advance"}, counter)
        stub_launches = STUB_LAUNCHES[0]
        fi_counter = _OpCounter()
        _advance(env)
        _step(env, {name: [] for name in timings if name != "advance"}, fi_counter=fi_counter)
        # The block appends between steps (the runner's _update_states): device ops they
        # dispatch, per step, averaged over 64 steps (each steady row crosses a block boundary
        # every block_size / q steps).
        appends = _OpCounter()
        with appends.mode:
            for _ in range(64):
                _advance(env)
        append_ops = sum(appends.counts.values()) / 64
    result = {name: statistics.median(v) * 1e3 if v else float("nan")
              for name, v in timings.items()}
    result["advances"] = advances
    slots = list(env["fi"]._graph_slots.values())
    result["refreshes"] = sum(s.refreshes for s in slots)
    result["plans"] = sum(s.native_replans + s.full_plans for s in slots)
    result["fi_ops"] = sum(fi_counter.counts.values())
    result["fi_copies"] = fi_counter.counts.get("copy_", 0)
    result["ops"] = sum(counter.counts.values())
    result["copies"] = counter.counts.get("copy_", 0)
    result["launches"] = result["ops"] + stub_launches
    result["build_ops"] = counter.build_ops
    result["build_copies"] = counter.build_copies
    result["build_launches"] = counter.build_launches
    result["append_ops"] = append_ops
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--q", type=int, nargs="+", default=[1, 4],
                        help="query length per row: 1 = plain decode, 1+k = uniform verify")
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--host-only", action=argparse.BooleanOptionalAction, default=True,
                        help="stub the CPU fallbacks of single-launch CUDA kernels (default on)")
    parser.add_argument("--clock", choices=("thread", "wall"), default="thread",
                        help="thread CPU time (default; steady on a shared box) or wall time")
    args = parser.parse_args()
    global _clock
    _clock = time.thread_time if args.clock == "thread" else time.perf_counter
    if args.repeats < 1 or args.warmup < 0:
        parser.error(f"--repeats={args.repeats} must be >= 1 and --warmup={args.warmup} >= 0")
    torch.set_num_threads(1)
    mode = "host-only (device prep stubbed)" if args.host_only else "full CPU path"
    print(f"# {mode}; {args.clock} clock; ctx {args.ctx}, block {args.block_size}, median of {args.repeats} steps, "
          f"ms per step")
    print("| Q | B | InputBatchBuilder.build | build_attn_metadata (TORCH_MLA) | CSR plan "
          "(numpy) | total | FLASHINFER_MLA builder | torch ops (copies) per step | "
          "build: torch ops (copies) | build: device launches | step: device launches | "
          "block appends: torch ops per step | FLASHINFER_MLA ops (copies) | "
          "FI refreshes / real plans | FI advance instead (steps it held) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for q in args.q:
        for batch in args.batch_sizes:
            r = bench(batch, q, args)
            print(f"| {q} | {batch} | {r['build']:.3f} | {r['attn']:.3f} | {r['csr']:.3f} | "
                  f"{r['total']:.3f} | {r['fi']:.3f} | {r['ops']} ({r['copies']}) | "
                  f"{r['build_ops']} ({r['build_copies']}) | {r['build_launches']} | "
                  f"{r['launches']} | {r['append_ops']:.2f} | {r['fi_ops']} ({r['fi_copies']}) | "
                  f"{r['refreshes']} / {r['plans']} | {r['advance']:.3f} "
                  f"({r['advances']} of {args.repeats}) |", flush=True)


if __name__ == "__main__":
    main()
