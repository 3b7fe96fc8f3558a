"""A spawned TP = DCP world (gloo, CPU) that runs the memory profile's dummy step on every rank
and then serves a scenario, next to a runner that was never profiled (memory_profile tests)."""
from __future__ import annotations

import pickle

import torch

from tests.utils.runner_harness import (NUM_BLOCKS, init_dist, make_config, run_scenario,
                                        spawn_world)


def _runner(paths, method, k, dcp, rank, profile: bool, max_model_len: int, budget: int):
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    config = make_config(paths.target, method, getattr(paths, method) if method else None, k=k,
                         dcp=dcp, max_model_len=max_model_len)
    config.max_num_batched_tokens = budget
    runner = GPUModelRunner(config, torch.device("cpu"), rank)
    runner.load_model()
    shape = None
    if profile:
        result = runner.profile_run()
        shape = (result.num_tokens, result.context_tokens)
    runner.initialize_kv_cache(get_kv_cache_config(runner.get_kv_cache_spec(),
                                                   num_blocks=NUM_BLOCKS,
                                                   dcp_size=runner.dcp_size))
    return runner, shape


def world_main(rank, world_size, port, paths, cases, scenario, max_model_len, budget, queue):
    try:
        init_dist(rank, world_size, port, dcp=world_size)
        out = {}
        for method, k in cases:
            profiled, shape = _runner(paths, method, k, world_size, rank, True, max_model_len,
                                      budget)
            plain, _ = _runner(paths, method, k, world_size, rank, False, max_model_len, budget)
            out[method or "plain"] = (shape, run_scenario(profiled, scenario).outputs,
                                      run_scenario(plain, scenario).outputs)
        if rank == 0:
            queue.put(("ok", pickle.dumps(out)))
    except BaseException:
        import traceback
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise
    finally:
        from vllm.distributed.parallel_state import (destroy_distributed_environment,
                                                     destroy_model_parallel)
        destroy_model_parallel()
        destroy_distributed_environment()


def spawn_profile_world(world_size, paths, cases, scenario, max_model_len, budget,
                        timeout_s: float = 300.0, pool=None) -> dict:
    """{case: ((new, context) of the profile, profiled outputs, never-profiled outputs)}.
    pool: a tests.utils.world_pool.WorldPool to run on (already started ranks), else fresh
    spawned processes."""
    return (pool.run if pool is not None else spawn_world)(
        world_main, world_size,
        lambda r, port, q: (r, world_size, port, paths, cases, scenario, max_model_len, budget, q),
        "profile world", timeout_s)
