"""The worker's GPU memory plan (vllm/v1/worker/gpu/memory_profile.py), on the CPU.

* MemoryProfile arithmetic with made-up numbers: KV budget = util * total - in use - non-torch -
  activation peak - graphs/buffers (capped by free memory), and a clear error naming the numbers
  and the fixes when nothing is left;
* Worker wiring with a stand-in runner and stand-in device readings: blocks = budget // bytes per
  block id, the fixed-size options still profile and log, the budget error reaches the caller;
* profile_run mechanics on the tiny model (a CPU runner runs the same dummy step): the step is
  max_num_batched_tokens new tokens after cached context, the context path runs, and a runner
  profiled before initialize_kv_cache afterwards produces exactly the tokens of a runner that
  never was (plain and with drafters), with the RNG streams untouched.
"""
from __future__ import annotations

import logging

import pytest
import torch

from tests.utils.runner_harness import NUM_BLOCKS, Scenario, make_config, run_scenario
from vllm.config import CacheConfig, VllmConfig
from vllm.model_executor.models.tiny import write_tiny_models
from vllm.v1.core.kv_cache_utils import get_kv_cache_config
from vllm.v1.kv_cache_interface import MLAAttentionSpec
from vllm.v1.worker.gpu import memory_profile as mp
from vllm.v1.worker.gpu.memory_profile import MemoryProfile, ProfileRunResult
from vllm.v1.worker.gpu.model_runner import GPUModelRunner
from vllm.v1.worker.gpu.worker import Worker

GIB = 1 << 30


def _profile(**kw) -> MemoryProfile:
    base = dict(total_bytes=80 * GIB, gpu_memory_utilization=0.9, weights_bytes=20 * GIB,
                torch_in_use_bytes=21 * GIB, non_torch_bytes=GIB // 2,
                activation_peak_bytes=3 * GIB, graph_buffer_estimate_bytes=GIB,
                profile_tokens=8192, free_bytes=58 * GIB)
    base.update(kw)
    return MemoryProfile(**base)


# ------------------------------------------------------------------------------ arithmetic
def test_budget_is_utilization_share_minus_everything_else():
    p = _profile()
    expected = int(80 * GIB * 0.9) - 21 * GIB - GIB // 2 - 3 * GIB - GIB
    assert p.requested_bytes == int(80 * GIB * 0.9)
    assert p.non_kv_cache_bytes == 21 * GIB + GIB // 2 + 3 * GIB + GIB
    assert p.profiled_kv_budget_bytes == expected == p.kv_budget_bytes == p.check_kv_budget()


def test_budget_is_capped_by_the_free_memory_other_processes_left():
    p = _profile(free_bytes=30 * GIB)  # another process holds memory
    assert p.profiled_kv_budget_bytes == 30 * GIB - 3 * GIB - GIB
    assert p.profiled_kv_budget_bytes < p.requested_bytes - p.non_kv_cache_bytes


@pytest.mark.parametrize("field,value", [("activation_peak_bytes", 60 * GIB),
                                         ("gpu_memory_utilization", 0.3)])
def test_no_room_raises_naming_the_numbers_and_the_fix(field, value):
    p = _profile(**{field: value})
    assert p.profiled_kv_budget_bytes <= 0
    with pytest.raises(ValueError) as err:
        p.check_kv_budget(rank=3)
    msg = str(err.value)
    assert "\n" not in msg and "rank 3" in msg
    for needle in (f"{p.gpu_memory_utilization:.2f} x 80.00 GiB", "in use 21.00 GiB",
                   f"activation peak {p.activation_peak_bytes / GIB:.2f} GiB", "8192-token",
                   "CUDA graphs + buffers 1.00 GiB", "gpu_memory_utilization",
                   "max_num_batched_tokens", "kv_cache_memory_bytes", "num_gpu_blocks_override"):
        assert needle in msg, needle


def test_fixed_kv_size_wins_and_planned_bytes_sum_the_measured_parts():
    p = _profile(fixed_kv_source="num_gpu_blocks_override", fixed_kv_bytes=5 * GIB)
    assert p.kv_budget_bytes == 5 * GIB
    assert "fixed by num_gpu_blocks_override" in p.kv_line()
    assert p.planned_bytes is None  # initialize_kv_cache has not run
    p.kv_cache_bytes, p.graph_buffer_bytes, p.runner_buffer_bytes = 5 * GIB, GIB // 4, GIB // 8
    p.first_step_cache_bytes = 32 << 20  # a cuBLAS workspace the profile step left
    assert p.static_bytes == 20 * GIB + GIB // 8 + (32 << 20) + 5 * GIB + GIB // 4
    assert p.planned_bytes == p.static_bytes + 3 * GIB


def test_log_writes_the_upstream_start_up_lines(caplog):
    p = _profile(load_seconds=1.5, kv_cache_bytes=10 * GIB, num_blocks=1000,
                 first_step_cache_bytes=32 << 20,
                 graph_buffer_bytes=GIB // 2, graph_capture_seconds=3.0,
                 graph_capture_bytes=GIB // 4, num_graphs=5)
    with caplog.at_level(logging.INFO, logger=mp.__name__):
        p.log()
    text = caplog.text
    for needle in ("Model loading took 20.0000 GiB and 1.50 seconds", "Memory profiling takes",
                   "torch peak memory increase: 3.00GiB", "8192-token step",
                   "first-step caches 0.03GiB",
                   f"Available KV cache memory: {p.kv_budget_bytes / GIB:.2f} GiB",
                   "KV cache: 1000 blocks, 10.00 GiB",
                   "Graph capturing finished in 3 secs, took 0.25 GiB"):
        assert needle in text, needle


# --------------------------------------------------------------------------- worker wiring
class _FakeRunner:
    def __init__(self, specs, result):
        self.specs, self.result, self.calls = specs, result, []
        self.kv_cache_config = None

    def get_kv_cache_spec(self):
        return self.specs

    def profile_run(self, num_tokens=None, estimate_graphs=False):
        self.calls.append(estimate_graphs)
        return self.result


def _gpu_worker(monkeypatch, cache: CacheConfig, free: int, allocated: int):
    """A worker that believes it is on a GPU: device readings and the runner are stand-ins."""
    spec = MLAAttentionSpec(16, dtype=torch.float32)
    specs = {"l0": spec, "l1": spec}
    worker = Worker(VllmConfig(cache_config=cache), rank=0)
    worker.device = torch.device("cuda", 0)
    result = ProfileRunResult(num_tokens=512, context_tokens=0, num_logit_rows=8,
                              step_peak_bytes=3 * GIB, sampler_peak_bytes=GIB,
                              graph_buffer_bytes=GIB)
    worker.model_runner = _FakeRunner(specs, result)
    worker.memory_profile = MemoryProfile(total_bytes=80 * GIB,
                                          gpu_memory_utilization=cache.gpu_memory_utilization,
                                          weights_bytes=10 * GIB)
    worker._init_memory = mp.DeviceMemory(free=79 * GIB, total=80 * GIB, allocated=0, reserved=0)
    reading = mp.DeviceMemory(free=free, total=80 * GIB, allocated=allocated,
                              reserved=allocated)
    monkeypatch.setattr(mp.DeviceMemory, "read", classmethod(lambda cls, *a, **k: reading))
    import vllm.v1.worker.gpu.worker as worker_module
    monkeypatch.setattr(worker_module, "DeviceMemory", mp.DeviceMemory)
    return worker, 2 * spec.page_size_bytes


def test_worker_sizes_the_cache_from_the_profile(monkeypatch):
    worker, per_block = _gpu_worker(monkeypatch, CacheConfig(block_size=16), free=68 * GIB,
                                    allocated=11 * GIB)
    blocks = worker.determine_num_available_blocks()
    # non-torch: (80 - 68 - 11) GiB now minus the 1 GiB held at start = 0.
    budget = int(80 * GIB * 0.9) - 11 * GIB - 0 - 3 * GIB - GIB
    assert blocks == budget // per_block
    assert worker.model_runner.calls == [True]  # graphs estimated
    assert worker.memory_profile.activation_peak_bytes == 3 * GIB
    assert worker.memory_profile.non_torch_bytes == 0


def test_fixed_options_still_profile_without_graphs(monkeypatch, caplog):
    worker, per_block = _gpu_worker(monkeypatch, CacheConfig(block_size=16,
                                                             num_gpu_blocks_override=7),
                                    free=68 * GIB, allocated=11 * GIB)
    with caplog.at_level(logging.INFO):
        assert worker.determine_num_available_blocks() == 7
    assert worker.model_runner.calls == [False]
    assert worker.memory_profile.kv_budget_bytes == 7 * per_block
    assert "fixed by num_gpu_blocks_override" in caplog.text
    assert "Memory profiling takes" in caplog.text

    worker, per_block = _gpu_worker(monkeypatch, CacheConfig(block_size=16,
                                                             kv_cache_memory_bytes=100 * per_block),
                                    free=68 * GIB, allocated=11 * GIB)
    assert worker.determine_num_available_blocks() == 100
    assert worker.memory_profile.fixed_kv_source == "kv_cache_memory_bytes"


def test_worker_records_what_the_profile_step_kept(monkeypatch, caplog):
    """Allocation after the profile run minus before it (a cuBLAS workspace on the GPU) is the
    plan's first-step caches: logged, and part of what the process holds between steps."""
    worker, _ = _gpu_worker(monkeypatch, CacheConfig(block_size=16), free=68 * GIB,
                            allocated=11 * GIB)
    readings = iter([11 * GIB, 11 * GIB + (32 << 20)])  # before the profile run, after it

    def read(cls, *args, **kwargs):
        allocated = next(readings)
        return mp.DeviceMemory(free=68 * GIB, total=80 * GIB, allocated=allocated,
                               reserved=allocated)

    monkeypatch.setattr(mp.DeviceMemory, "read", classmethod(read))
    with caplog.at_level(logging.INFO):
        worker.determine_num_available_blocks()
    plan = worker.memory_profile
    assert plan.first_step_cache_bytes == 32 << 20
    assert plan.torch_in_use_bytes == 11 * GIB + (32 << 20)
    assert "first-step caches 0.03GiB" in caplog.text


def test_worker_raises_the_budget_error(monkeypatch):
    worker, _ = _gpu_worker(monkeypatch, CacheConfig(block_size=16, gpu_memory_utilization=0.15),
                            free=68 * GIB, allocated=11 * GIB)
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache.*activation peak"):
        worker.determine_num_available_blocks()


def test_cpu_worker_has_no_memory_profile():
    worker = Worker(VllmConfig(), rank=0)
    assert worker.device.type == "cpu" and worker.memory_profile is None


# ------------------------------------------------------------------- profile_run on the CPU
@pytest.fixture(scope="module")
def paths():
    return write_tiny_models()


def _runner(paths, method=None, k=3, max_model_len=256, budget=512, profile=False,
            num_blocks=NUM_BLOCKS):
    cfg = make_config(paths.target, method, getattr(paths, method) if method else None, k=k,
                      max_model_len=max_model_len)
    cfg.max_num_batched_tokens = budget
    runner = GPUModelRunner(cfg, torch.device("cpu"), 0)
    runner.load_model()
    result = runner.profile_run() if profile else None
    runner.initialize_kv_cache(get_kv_cache_config(runner.get_kv_cache_spec(),
                                                   num_blocks=num_blocks,
                                                   dcp_size=runner.dcp_size))
    return runner, result


def test_profile_step_prefills_the_budget_after_cached_context(paths, monkeypatch):
    from vllm.v1.attention.backends.mla import prefill
    seen = []
    original = prefill.context_attention_torch

    def spy(q, kv_cache, w_kv_b, meta, *args):
        seen.append((q.shape[0], sum(c.num_tokens for c in meta.context_chunks)))
        return original(q, kv_cache, w_kv_b, meta, *args)

    monkeypatch.setattr(prefill, "context_attention_torch", spy)
    cfg = make_config(paths.target, max_model_len=1024)
    cfg.max_num_batched_tokens = 96
    runner = GPUModelRunner(cfg, torch.device("cpu"), 0)
    runner.load_model()
    result = runner.profile_run()
    # Two context passes of the default chunk do not fit: the context is what max_model_len
    # leaves after the step's tokens.
    assert (result.num_tokens, result.context_tokens) == (96, 1024 - 96)
    assert result.num_logit_rows == min(cfg.max_num_seqs, 96)
    layers = len([n for n in runner.get_kv_cache_spec()])
    assert seen == [(96, 1024 - 96)] * layers
    # Nothing of the temporary state is left on the runner.
    assert runner.kv_cache_config is None and runner.kv_caches == {}
    assert runner.block_tables is None and runner.attn_metadata_builders == []
    assert all(layer.kv_cache is None for layer in runner._attention_layers().values())
    assert len(runner.requests.by_id) == 0


def test_profile_run_refuses_a_runner_with_a_kv_cache(paths):
    runner, _ = _runner(paths)
    with pytest.raises(RuntimeError, match="before initialize_kv_cache"):
        runner.profile_run()


@pytest.mark.parametrize("method,k", [(None, 0), ("eagle", 3), ("dspark", 4)])
def test_profiled_runner_generates_what_an_unprofiled_one_does(paths, method, k):
    prompts = {"a": [(7 * i + 3) % 256 for i in range(23)],
               "b": [(5 * i + 11) % 256 for i in range(40)]}
    scenario = Scenario("profile", prompts, max_new_tokens=6, arrival_step={"b": 1},
                        prefill_chunk=16)
    torch.manual_seed(1234)
    rng = torch.get_rng_state()
    profiled, result = _runner(paths, method, k or 3, profile=True)
    assert torch.equal(torch.get_rng_state(), rng)  # the dummy sampling drew in a fork
    assert result.num_tokens == 256  # max_model_len caps the 512-token budget
    plain, _ = _runner(paths, method, k or 3)
    assert sorted(profiled.kv_caches) == sorted(plain.kv_caches)
    assert all(profiled.kv_caches[n].shape == plain.kv_caches[n].shape for n in plain.kv_caches)
    assert run_scenario(profiled, scenario).outputs == run_scenario(plain, scenario).outputs


def test_profile_under_dcp2_runs_the_same_step_on_both_ranks(paths, cpu_world_pool):
    """The dummy step's context passes run DCP collectives: both ranks must take it (else the
    world hangs), and the profiled ranks then serve exactly what never-profiled ranks do."""
    from tests.utils.memory_profile_world import spawn_profile_world
    prompts = {"a": [(7 * i + 3) % 256 for i in range(37)],
               "b": [(5 * i + 11) % 256 for i in range(20)]}
    scenario = Scenario("profile-dcp", prompts, max_new_tokens=5, arrival_step={"b": 1},
                        prefill_chunk=16)
    out = spawn_profile_world(2, paths, [(None, 0), ("dspark", 4)], scenario,
                              max_model_len=512, budget=64, pool=cpu_world_pool)
    for case, (shape, profiled, plain) in out.items():
        assert shape == (64, 512 - 64), case
        assert profiled == plain, case
