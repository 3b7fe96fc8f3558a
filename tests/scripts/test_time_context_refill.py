"""scripts/time_context_refill.py: its plain-step A/B really alternates the two plain steps it
compares (the context-free one of a refill engine, and one that writes the drafter's context
KV), only for the blocks it means, and the whole script runs through on the CPU."""
from __future__ import annotations

from tests.utils.call_probes import count_calls
from tests.utils.scripts import load_script, run_script


def _cannot_pay_refill_engine(script, monkeypatch, batch: int):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.worker.gpu.spec_decode.context_refill import ENV_FLAG

    monkeypatch.setenv(ENV_FLAG, "1")
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=None, dtype="float32", attention_backend="TORCH_MLA", device="cpu",
        max_model_len=256, max_num_seqs=batch, async_scheduling=False,
        speculative_config={"method": "dspark", "num_speculative_tokens": 4,
                            "disable_by_batch_size": "auto"}, seed=0))
    script.no_probe_cost_model(engine)
    params = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [(3 + 5 * i + 7 * j) % 200 + 10 for j in range(20)], params)
    for _ in range(16):  # past the policy's first look: every later step is plain
        engine.step()
    return engine


def test_the_write_blocks_write_and_the_free_blocks_do_not(monkeypatch):
    script = load_script("time_context_refill.py")
    engine = _cannot_pay_refill_engine(script, monkeypatch, batch=2)
    try:
        runner = engine.executor.worker.model_runner
        writes = count_calls(runner.speculator, "precompute_context")
        free_ms, write_ms = script.time_plain_steps(engine, blocks=2, block_steps=5,
                                                    device="cpu", batch=2)
        assert free_ms > 0 and write_ms > 0
        # 2 write blocks of 5 plain steps: each writes once; the free blocks write nothing
        # (the refill engine's own plain step), so the skipped positions are stale after it
        assert writes[0] == 10
        assert runner._context_refill.any_stale
        assert "_skips_context" not in runner.__dict__  # the runner's own choice is back
        for _ in range(3):
            engine.step()
        assert writes[0] == 10
    finally:
        engine.shutdown()


def test_the_script_runs_on_the_cpu():
    out = run_script("time_context_refill.py", "--device", "cpu", "--dtype", "float32",
                     "--attention-backend", "TORCH_MLA", "--batch", "2", "--tokens", "4",
                     "--repeats", "1", "--blocks", "1", "--block-steps", "4").stdout
    rows = [line for line in out.splitlines() if line.startswith("| 2 |")]
    assert any("plain step, context-free / writing" in r for r in rows), out
    for path in ("decode", "prefill"):
        timed = [r for r in rows if f"| {path} | 0 |" in r]
        assert len(timed) == 1, out
        # the last column: the refill against the saving of the 4 plain steps it follows
        last = timed[0].strip("| ").split(" | ")[-1]
        assert last.startswith("never") or float(last) > 0, timed
