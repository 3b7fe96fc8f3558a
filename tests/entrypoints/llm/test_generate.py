"""vllm.LLM on the built-in tiny model (CPU): greedy output equals Hugging Face transformers'
greedy decoding of the same checkpoint, with and without speculative decoding, under KV-cache
pressure (preemption by recompute), and over two gloo worker processes (TP=2, DCP=2)."""
import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.model_executor.models.tiny import write_tiny_models

MAX_TOKENS = 10
PROMPTS = ["The engine", [5, 17, 29, 41, 53, 65, 77, 89, 101, 113, 125], [200, 3]]


@pytest.fixture(scope="module")
def tiny():
    return write_tiny_models()


@pytest.fixture(scope="module")
def hf_greedy(tiny):
    """Plain greedy decoding with transformers (full forward each step, no KV cache)."""
    import transformers
    from vllm.transformers_utils.tokenizer import get_tokenizer
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # module fixtures run before the per-test single-thread fixture
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(tiny.target, dtype=torch.float32).eval()
    tokenizer = get_tokenizer(tiny.target)
    results = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            out = []
            for _ in range(MAX_TOKENS):
                logits = model(torch.tensor([ids + out])).logits[0, -1]
                out.append(int(logits.argmax()))
            results.append(out)
    torch.set_num_threads(threads)
    return results


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    with LLM(max_model_len=128, max_num_seqs=4, device="cpu") as engine:
        yield engine


def test_llm_greedy_matches_transformers_and_seeded_sampling_reproduces(llm, hf_greedy):
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _token_ids(outputs) == hf_greedy
    assert outputs[0].prompt == "The engine"
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)
    # A list of SamplingParams, one per prompt; results stay in input order.
    short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    mixed = llm.generate(PROMPTS, [short, GREEDY, short], use_tqdm=False)
    assert _token_ids(mixed) == [hf_greedy[0][:3], hf_greedy[1], hf_greedy[2][:3]]
    # Seeded random sampling is reproducible across calls.
    first = _token_ids(llm.generate(PROMPTS[1], SEEDED, use_tqdm=False))
    second = _token_ids(llm.generate(PROMPTS[1], SEEDED, use_tqdm=False))
    assert first == second
    assert llm.llm_engine.get_metrics()["spec_decode"] is None


def test_llm_spec_decode_under_kv_pressure_matches_transformers(hf_greedy):
    # max_model_len 40 with 4-token blocks: one request needs cdiv(40 + 3 + 1, 4) = 11 blocks,
    # and that is all there is, so the three requests must preempt each other.
    with LLM(max_model_len=40, block_size=4, num_gpu_blocks_override=11, max_num_seqs=4,
             device="cpu",
             speculative_config={"method": "dspark", "num_speculative_tokens": 3}) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        metrics = llm.llm_engine.get_metrics()
    assert _token_ids(outputs) == hf_greedy
    assert metrics["num_preemptions"] > 0
    spec = metrics["spec_decode"]
    # Drafts are only trimmed near max_model_len, which these requests never reach.
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] == 3 * spec["num_drafts"]
    assert len(spec["accepted_per_position"]) == 3
    assert spec["mean_acceptance_length"] == pytest.approx(
        1 + spec["num_accepted_tokens"] / spec["num_drafts"])
    assert metrics["kv_cache_usage"] == 0.0


def test_llm_rejects_unknown_arguments_and_bad_prompts(llm):
    with pytest.raises(ValueError, match="max_modl_len"):
        LLM(max_modl_len=64)
    with pytest.raises(ValueError, match="neither a string nor a list of token ids"):
        llm.generate([["a"]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)


@pytest.mark.slow
def test_llm_tp2_dcp2_gloo_workers_match_transformers(hf_greedy):
    config = dict(max_model_len=128, max_num_seqs=4, device="cpu",
                  speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    with LLM(**config) as single:
        seeded_single_rank = _token_ids(single.generate(PROMPTS, SEEDED, use_tqdm=False))
    with LLM(tensor_parallel_size=2, decode_context_parallel_size=2, **config) as tp_llm:
        outputs = tp_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert tp_llm.llm_engine.get_metrics()["spec_decode"]["num_drafts"] > 0
        # Both ranks draw the same random numbers (per-request generators), so seeded sampling
        # gives what one rank gives; a rank drifting apart would change the tokens.
        seeded = _token_ids(tp_llm.generate(PROMPTS, SEEDED, use_tqdm=False))
    assert _token_ids(outputs) == hf_greedy
    assert seeded == seeded_single_rank
