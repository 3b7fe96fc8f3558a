"""Block drafters (DSpark, DFlash) skip their draft pass in steps where every row is an unfinished
prefill chunk: their context KV is written inside the target forward, so drafts of those steps
would only be thrown away. Greedy output equals plain greedy, chunked or not, and the draft
pass runs exactly once per step that samples (tiny model, CPU)."""
from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams

PROMPT = [(11 * j) % 200 + 20 for j in range(70)]  # 70 tokens: 5 chunks of 16
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def generate(method: str | None, counts: dict | None = None) -> list[int]:
    spec = None if method is None else {"method": method, "num_speculative_tokens": 3}
    with LLM(device="cpu", max_model_len=128, max_num_seqs=2, max_num_batched_tokens=16,
             speculative_config=spec) as llm:
        if counts is not None:
            runner = llm.llm_engine.executor.worker.model_runner
            inner_propose, inner_execute = runner.speculator.propose, runner.execute_model

            def propose(inputs):
                counts["proposes"] += 1
                return inner_propose(inputs)

            def execute_model(scheduler_output):
                out = inner_execute(scheduler_output)
                counts["sampling_steps"] += any(len(t) > 0 for t in out.sampled_token_ids)
                return out

            runner.speculator.propose = propose
            runner.execute_model = execute_model
        out = llm.generate([PROMPT], GREEDY, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


@pytest.fixture(scope="module")
def plain():
    return generate(None)


@pytest.mark.parametrize("method", ["dspark", "dflash"])
def test_block_drafter_drafts_only_after_the_prefill(plain, method):
    counts = {"proposes": 0, "sampling_steps": 0}
    assert generate(method, counts) == plain
    # 70 prompt tokens at a budget of 16: four steps of unfinished chunks, then every step samples.
    assert counts["sampling_steps"] >= 1
    assert counts["proposes"] == counts["sampling_steps"]
