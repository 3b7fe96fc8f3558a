"""The sampling ops and the runner's SamplingStates on CUDA give the CPU results (GPU node)."""
import pytest
import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logprobs import compute_logprobs, gather_logprobs
from vllm.v1.sample.ops.penalties import segment_draft_counts
from vllm.v1.worker.gpu.sample_utils import BatchRows, SamplingStates

pytestmark = pytest.mark.gpu

V = 300


def _run(device):
    states = SamplingStates(max_num_reqs=4, vocab_size=V, device=torch.device(device))
    a = SamplingParams(temperature=0.7, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.3,
                       repetition_penalty=1.2, logit_bias={7: 3.0}, min_tokens=5, logprobs=3)
    a.update_from_tokenizer(eos_token_id=2)
    b = SamplingParams(temperature=0.0, allowed_token_ids=list(range(0, V, 3)), logprobs=-1)
    b.update_from_tokenizer(eos_token_id=2)
    states.add_request("a", 1, [5, 6, 7, 9, 9], a)
    states.add_request("b", 3, [1, 2], b)
    rows = BatchRows(["a", "b"], [1, 3], [[4, 4, 8], []], [[5, 6, 7, 9, 9], [1, 2]])
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, V, generator=g).to(device)
    out = states.process_logits(logits, rows)
    lps = states.after_sampling(logits, rows, [[4, 4], [9]])
    return out.cpu(), lps, states.num_output.cpu()


def test_sampling_states_cuda_equals_cpu():
    cpu_out, cpu_lps, cpu_num = _run("cpu")
    gpu_out, gpu_lps, gpu_num = _run("cuda")
    assert torch.equal(torch.isinf(cpu_out), torch.isinf(gpu_out))
    finite = ~torch.isinf(cpu_out)
    torch.testing.assert_close(cpu_out[finite], gpu_out[finite], rtol=1e-5, atol=1e-5)
    assert torch.equal(cpu_num, gpu_num)
    for req in ("a", "b"):
        assert cpu_lps[req].logprob_token_ids[0][0] == gpu_lps[req].logprob_token_ids[0][0]
        assert cpu_lps[req].sampled_token_ranks == gpu_lps[req].sampled_token_ranks
        torch.testing.assert_close(torch.tensor(cpu_lps[req].logprobs),
                                   torch.tensor(gpu_lps[req].logprobs), rtol=1e-5, atol=1e-5)


def test_ops_cuda_equal_cpu():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, V, generator=g)
    tokens = torch.randint(0, V, (6,), generator=g)
    cpu = gather_logprobs(compute_logprobs(logits), 5, tokens).tolists()
    gpu = gather_logprobs(compute_logprobs(logits.cuda()), 5, tokens.cuda()).tolists()
    assert cpu.logprob_token_ids == gpu.logprob_token_ids
    assert cpu.sampled_token_ranks == gpu.sampled_token_ranks
    args = (torch.tensor([0, 0, 0, 3, 4, 4]), torch.tensor([0, 1, 4]), torch.tensor([9, 9, 2]))
    ref = segment_draft_counts(*args, 6, V)
    got = segment_draft_counts(*(a.cuda() for a in args), 6, V)
    assert torch.equal(ref, got.cpu())
