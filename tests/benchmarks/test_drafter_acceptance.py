"""vllm/benchmarks/drafter_acceptance.py: the offline replay of greedy DSpark verification.

Oracles: hand-worked sequences for the counting, and a CPU engine for the replay (its drafting
steps must be exactly the walk's)."""
from __future__ import annotations

import torch

from vllm.benchmarks import drafter_acceptance as da


def test_accepted_lengths_count_the_leading_matches_and_the_bonus():
    gold = torch.tensor([[5, 6, 7, 8]] * 4)
    pred = torch.tensor([[5, 6, 7, 8],   # all 4 + bonus
                         [5, 6, 0, 8],   # a miss at row 2: later matches do not count
                         [0, 6, 7, 8],   # nothing accepted: the bonus token alone
                         [5, 0, 0, 0]])
    assert da.accepted_lengths(pred, gold).tolist() == [5, 3, 1, 2]


def test_walk_jumps_by_what_each_step_accepted():
    # anchors 0..7: from 0 gain 3 -> anchor 3 gains 1 -> 4 gains 2 -> 6 gains 5 (overshoots)
    assert da.walk([3, 9, 9, 1, 2, 9, 5, 9]) == 4
    assert da.walk([1] * 6) == 6
    assert da.walk([]) == 0


def test_ceilings_are_tokens_over_steps_of_one_and_of_the_slowest_request():
    s = da.AcceptanceSummary(per_anchor=[3.0, 2.0, 1.5], tokens_per_step=[4.0, 2.0, 1.0],
                             steps=[10, 20, 40], tokens=40)
    assert s.equal_cost_ceilings() == {"B=1": 4.0, "B=3": 1.0}


def test_prompt_sets_have_the_asked_shape_and_the_benchmarks_tokens():
    bench = da.benchmark_prompts(3, 5)
    assert bench.shape == (3, 5) and bench[2, 4].item() == (7 * 2 + 13 * 4) % 200 + 20
    held = da.textwrap_prompts(2, 16)
    assert held.shape == (2, 16) and int(held.max()) < 256


def test_the_walk_is_the_drafting_steps_of_a_cpu_engine():
    from vllm.entrypoints.llm import LLM
    from vllm.model_executor.models import tiny
    from vllm.sampling_params import SamplingParams

    paths = tiny.write_tiny_models()
    configs = tiny.tiny_family_configs()
    weights = tiny.load_shipped_weights(configs)
    prompts, n = da.benchmark_prompts(4, 64)[2:], 40  # one fast request, one slow (AL ~1.4)
    replay = da.dspark_acceptance(weights["target"], configs["target"][0], weights["dspark"],
                                  configs["dspark"][0], prompts, n)
    spec = {"method": "dspark", "model": paths.dspark, "num_speculative_tokens": 4}
    with LLM(paths.target, speculative_config=spec, device="cpu", max_model_len=256) as llm:
        llm.generate([{"prompt_token_ids": p.tolist()} for p in prompts],
                     SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        drafts = llm.llm_engine.get_metrics()["spec_decode"]["num_drafts"]
    assert drafts == sum(replay.steps), (drafts, replay.steps)
    assert replay.steps[0] < replay.steps[1]  # the two requests really differ
