"""Host cost of a steady decode step's input and metadata builders, measured on the CPU.

Builds the runner's pieces on device="cpu" (RequestStates, BlockTables, InputBatchBuilder, the
MLA metadata builder of TORCH_MLA) and times, with perf_counter (median of --repeats steps):

  * `build`    InputBatchBuilder.build of a steady decode (or uniform verify) layout;
  * `attn`     build_attn_metadata with the runner's arguments (one KV cache group);
  * `csr`      plan_hopper_decode on that step's decode metadata into a graph-sized PlanStaging
               ring (the FlashInfer builder's host CSR plan; pure numpy, runs without CUDA);
  * `total`    the three together;
  * the ATen ops (and copy_ ops) one step dispatches, views excluded (each one costs a CUDA host
    ~5-10 us, which the CPU run hides).

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

import torch


@contextmanager
def _stub_device_prep(enabled: bool):
    """Replace the CPU torch fallbacks of single-launch CUDA kernels by no-ops."""
    if not enabled:
        yield
        return
    from vllm.v1.attention.backends.mla import common as mla_common
    from vllm.v1.worker.gpu import block_table, input_batch
    saved = [(input_batch.InputBatchBuilder, "_prepare_torch"),
             (block_table.BlockTables, "_compute_slot_mappings_torch"),
             (mla_common.MLACommonMetadataBuilder, "_row_seq_lens")]
    originals = [getattr(owner, name) for owner, name in saved]

    def row_seq_lens_stub(self, cm, num_decodes, num_tokens, causal, local_seq_lens):
        out, req, pos = self._row_buffers(num_tokens, cm.seq_lens.device)
        return out[:num_tokens], req[:num_tokens], pos[:num_tokens]

    input_batch.InputBatchBuilder._prepare_torch = lambda self, *a, **k: None
    block_table.BlockTables._compute_slot_mappings_torch = lambda self, *a, **k: None
    mla_common.MLACommonMetadataBuilder._row_seq_lens = row_seq_lens_stub
    try:
        yield
    finally:
        for (owner, name), original in zip(saved, originals):
            setattr(owner, name, original)


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

    pages = max_plan_requests(batch, q, 1) * (max_blocks + 1)
    staging = PlanStaging(max_plan_requests(batch, q, 1), pages, depth=2)
    return dict(states=states, tables=tables, rows=rows, builder=builder, mla=mla, cfg=_Cfg(),
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


def _step(env, timings) -> None:
    from vllm.v1.attention.backends.mla.flashinfer_mla import plan_hopper_decode
    from vllm.v1.worker.gpu.attn_utils import build_attn_metadata
    rows, q = env["rows"], env["q"]
    B = len(rows)
    counts, drafts, samples, host_ids = [q] * B, [q - 1] * B, [True] * B, [None] * B
    t0 = time.perf_counter()
    batch = env["builder"].build(rows, counts, drafts, samples, host_ids, env["states"],
                                 env["tables"], num_reqs_padded=B, num_tokens_padded=B * q)
    batch.cudagraph = True
    t1 = time.perf_counter()
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
    t2 = time.perf_counter()
    decode = md["layer0"].decode
    plan_hopper_decode(decode, env["block_size"], "auto", num_requests=B,
                       staging=env["staging"])
    t3 = time.perf_counter()
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


def bench(batch: int, q: int, args) -> dict[str, float]:
    env = _setup(batch, q, args.ctx, args.block_size, max(args.batch_sizes) * 2,
                 args.max_model_len)
    timings = {name: [] for name in ("build", "attn", "csr", "total")}
    with _stub_device_prep(args.host_only), torch.inference_mode():
        for _ in range(args.warmup):
            _advance(env)
            _step(env, {name: [] for name in timings})
        for _ in range(args.repeats):
            _advance(env)
            _step(env, timings)
        counter = _OpCounter()
        _advance(env)
        with counter.mode:
            _step(env, {name: [] for name in timings})
    result = {name: statistics.median(v) * 1e3 for name, v in timings.items()}
    result["ops"] = sum(counter.counts.values())
    result["copies"] = counter.counts.get("copy_", 0)
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
    args = parser.parse_args()
    if args.repeats < 1 or args.warmup < 0:
        parser.error(f"--repeats={args.repeats} must be >= 1 and --warmup={args.warmup} >= 0")
    torch.set_num_threads(1)
    mode = "host-only (device prep stubbed)" if args.host_only else "full CPU path"
    print(f"# {mode}; ctx {args.ctx}, block {args.block_size}, median of {args.repeats} steps, "
          f"ms per step")
    print("| Q | B | InputBatchBuilder.build | build_attn_metadata | CSR plan (numpy) | total "
          "| torch ops (copies) per step |")
    print("|---|---|---|---|---|---|---|")
    for q in args.q:
        for batch in args.batch_sizes:
            r = bench(batch, q, args)
            print(f"| {q} | {batch} | {r['build']:.3f} | {r['attn']:.3f} | {r['csr']:.3f} | "
                  f"{r['total']:.3f} | {r['ops']} ({r['copies']}) |", flush=True)


if __name__ == "__main__":
    main()
