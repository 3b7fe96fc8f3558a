"""Host cost of the scheduler's part of a steady decode step (schedule + update_from_output +
record_step_time), no model: a plain engine against speculative engines whose policy lets
nobody draft (disable_by_batch_size=1, and "auto" with drafting that cannot pay). Median of the
steps after a warm-up, best of --repeats runs, in microseconds.

    PYTHONPATH=. OMP_NUM_THREADS=1 python scripts/bench_spec_sched.py [--batch-sizes 1 8 32]
"""
from __future__ import annotations

import argparse
import statistics
import time

from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.request import Request
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.spec_decode.cost_model import SPEC

POLICIES = ("plain", "never", "auto-nopay")


def make_scheduler(policy: str, batch: int, k: int) -> Scheduler:
    spec = None
    if policy != "plain":
        spec = SpeculativeConfig(method="dspark", model="unused", num_speculative_tokens=k,
                                 disable_by_batch_size=1 if policy == "never" else "auto")
    config = VllmConfig(model_config=ModelConfig(model=None, max_model_len=4096),
                        cache_config=CacheConfig(block_size=16), parallel_config=ParallelConfig(),
                        speculative_config=spec, max_num_seqs=batch, max_num_batched_tokens=4096)
    s = Scheduler(config, num_blocks=40000)
    if policy == "auto-nopay":
        model = s.spec_policy.cost_model
        model.acceptance_override = 1.0
        model.step_time_fn = lambda kind, b, c: 2.0 if kind == SPEC else 1.0
    for i in range(batch):
        params = SamplingParams(temperature=0.0, max_tokens=3000, ignore_eos=True)
        s.add_request(Request(request_id=f"r{i}", prompt_token_ids=list(range(20, 84)),
                              sampling_params=params, eos_token_id=None, max_tokens=3000))
    return s


def run(policy: str, batch: int, steps: int, k: int) -> tuple[float, float]:
    s = make_scheduler(policy, batch, k)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        so = s.schedule()
        t1 = time.perf_counter()
        ids = list(so.num_scheduled_tokens)
        drafts = so.scheduled_spec_decode_tokens
        # The runner's output: every draft rejected, drafts proposed when asked (a block
        # drafter: no draft pass, one shared empty list per row, when nobody drafts).
        out = ModelRunnerOutput(
            req_ids=ids, sampled_token_ids=[[7] for _ in ids],
            num_draft_tokens=[len(drafts.get(r, ())) for r in ids],
            spec_token_ids=None if policy == "plain" else (
                [[-1] * k] * len(ids) if so.propose_drafts else [[]] * len(ids)))
        t2 = time.perf_counter()
        s.update_from_output(so, out)
        s.record_step_time(so, 1.0)
        t3 = time.perf_counter()
        if i >= steps // 10:
            times.append(((t1 - t0) * 1e6, (t3 - t2) * 1e6))
    return (statistics.median(t[0] for t in times), statistics.median(t[1] for t in times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    print("| B | policy | schedule us | update us |\n|---|---|---|---|")
    for batch in args.batch_sizes:
        for policy in POLICIES:
            sched_us, update_us = min(run(policy, batch, args.steps, args.k)
                                      for _ in range(args.repeats))
            print(f"| {batch} | {policy} | {sched_us:.1f} | {update_us:.1f} |", flush=True)


if __name__ == "__main__":
    main()
