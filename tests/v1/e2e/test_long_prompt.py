"""Long prompts through vllm.LLM on CPU (tiny model, YaRN rope): a prompt longer than the step
budget is prefilled in chunks by default (issue #11's repro: 5000 tokens, budget 4096) and gives
the same greedy tokens as whole-prompt prefill; the limits keep their clear errors; a 32k-token
prompt at budget 2048 completes with peak RSS growth below 2 GB."""
import json
import os
import subprocess
import sys

import pytest

from vllm import LLM, SamplingParams
from vllm.model_executor.models.tiny import write_random_target, yarn_rope_scaling

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


@pytest.fixture(scope="module")
def yarn_model(tmp_path_factory):
    """The tiny target with YaRN rope stretched to 40960 positions (32x 1280)."""
    model_dir = str(tmp_path_factory.mktemp("yarn_long"))
    write_random_target(model_dir, seed=1, max_position_embeddings=40960,
                        rope_scaling=yarn_rope_scaling(factor=32.0,
                                                       original_max_position_embeddings=1280))
    return model_dir


@pytest.fixture(scope="module")
def yarn_model_two_layers(tmp_path_factory):
    """The same YaRN target with two layers (one dense, one MoE: every layer kind of the three-layer
    target) for the 32k memory probe. What the probe bounds is the transient memory of one step,
    which is freed layer by layer and does not add up over layers; the third layer only added a
    third of the 32k prefill's compute (the quadratic context attention dominates the CPU suite)."""
    model_dir = str(tmp_path_factory.mktemp("yarn_long_2l"))
    write_random_target(model_dir, seed=1, max_position_embeddings=40960, num_hidden_layers=2,
                        rope_scaling=yarn_rope_scaling(factor=32.0,
                                                       original_max_position_embeddings=1280))
    return model_dir


def _prompt(n):
    return [(5 * i * i + i) % 250 + 4 for i in range(n)]


@pytest.mark.slow
def test_prompt_longer_than_the_budget_is_chunked_by_default(yarn_model):
    with LLM(model=yarn_model, max_model_len=8192, device="cpu") as llm:
        assert llm.llm_engine.vllm_config.enable_chunked_prefill is True
        assert llm.llm_engine.vllm_config.max_num_batched_tokens == 4096
        chunked = llm.generate([_prompt(5000)], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(model=yarn_model, max_model_len=8192, device="cpu", enable_chunked_prefill=False,
             max_num_batched_tokens=8192) as llm:
        whole = llm.generate([_prompt(5000)], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert len(chunked) == 4 and list(chunked) == list(whole)


def test_limits_keep_their_clear_errors(yarn_model):
    with LLM(model=yarn_model, max_model_len=64, device="cpu", max_num_batched_tokens=16) as llm:
        assert len(llm.generate([_prompt(40)], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 4
        with pytest.raises(ValueError, match=r"65 tokens.*max_model_len=64"):
            llm.generate([_prompt(65)], GREEDY, use_tqdm=False)
    with LLM(model=yarn_model, max_model_len=64, device="cpu", max_num_batched_tokens=16,
             enable_chunked_prefill=False) as llm:
        with pytest.raises(ValueError, match=r"40 tokens.*max_num_batched_tokens=16"):
            llm.generate([_prompt(40)], GREEDY, use_tqdm=False)


@pytest.mark.slow
def test_32k_prompt_completes_with_bounded_memory(yarn_model_two_layers):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "tests.utils.long_prompt_probe",
                           yarn_model_two_layers,
                           "32768", "2048"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["token_ids"]) == 4
    growth_gb = (result["peak_rss_kb"] - result["rss_before_kb"]) / 2**20
    assert growth_gb < 2.0, f"peak RSS grew by {growth_gb:.2f} GB during the 32k prefill"


@pytest.mark.slow
@pytest.mark.parametrize("method,k", [("eagle", 3), ("mtp", 3), ("dflash", 3), ("dspark", 4)])
def test_engine_chunked_prefill_with_drafters_equals_plain_whole_prefill(method, k):
    """The real scheduler + runner + drafter with a 16-token budget (prompts of 37 and 23 tokens
    are prefilled over several steps while the other request decodes): greedy output equals
    plain greedy with whole-prompt prefill."""
    prompts = [_prompt(37), _prompt(23)[::-1], [9, 8]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(max_model_len=128, device="cpu", enable_chunked_prefill=False,
             max_num_batched_tokens=256) as llm:
        expected = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                                          use_tqdm=False)]
    with LLM(max_model_len=128, device="cpu", max_num_batched_tokens=16, max_num_seqs=3,
             speculative_config={"method": method, "num_speculative_tokens": k}) as llm:
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                                     use_tqdm=False)]
        stats = llm.llm_engine.get_metrics()
    assert got == expected
    assert stats["spec_decode"]["num_drafts"] > 0
