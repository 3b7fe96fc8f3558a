"""GPU checks of the models (run with `pytest -m gpu tests/models` on the H200 node).

* float32 on CUDA with TORCH_MLA equals the Hugging Face oracle (prefill + paged decode);
* bfloat16 with FLASHINFER_MLA tracks float32 TORCH_MLA on the same paged schedule, incl. the
  DSpark drafter's non-causal block after its context-KV precompute.
"""
import pytest
import torch

from tests.utils.paged_harness import PagedRequest, PagedRunner, hf_logits
from vllm.config import ModelConfig, SpeculativeConfig, VllmConfig
from vllm.forward_context import set_forward_context
from vllm.model_executor.model_loader import get_draft_model, get_model
from vllm.model_executor.models.tiny import MASK_ID, write_random_target, write_tiny_models
from vllm.forward_context import dense_attention_context

PROMPT_A = [(7 * i * i + 3 * i + 11) % 256 for i in range(40)]
PROMPT_B = [(5 * i + 101) % 256 for i in range(29)]
CHUNKS_A = [17, 1, 1, 4, 1, 8, 1, 7]
CHUNKS_B = [9, 1, 3, 1, 15]


def _cfg(model_dir, dtype, backend, draft=None, method=None):
    spec = None if draft is None else SpeculativeConfig(method=method, model=draft, num_speculative_tokens=3)
    return VllmConfig(model_config=ModelConfig(model=model_dir, dtype=dtype, device="cuda",
                                               attention_backend=backend), speculative_config=spec)


def _paged(model, dtype, backend, block_size=16):
    runner = PagedRunner(model, block_size=block_size, num_blocks=32, dtype=dtype, device="cuda", backend=backend)
    return runner.run([PagedRequest(PROMPT_A, CHUNKS_A), PagedRequest(PROMPT_B, CHUNKS_B, start_step=2)])


def _rel(a, b):
    return (a - b).abs().max().item() / b.abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": None, "first_k_dense_replace": 3}])
def test_cuda_float32_torch_mla_matches_hf(tmp_path, overrides):
    write_random_target(str(tmp_path), seed=3, **overrides)
    model = get_model(_cfg(str(tmp_path), "float32", "TORCH_MLA"))
    torch.backends.cuda.matmul.allow_tf32 = False
    a, b = _paged(model, torch.float32, "TORCH_MLA")
    assert _rel(a, hf_logits(str(tmp_path), PROMPT_A)) <= 1e-4
    assert _rel(b, hf_logits(str(tmp_path), PROMPT_B)) <= 1e-4


@pytest.mark.gpu
def test_flashinfer_bf16_tracks_torch_mla_fp32(tmp_path):
    pytest.importorskip("flashinfer")
    paths = write_tiny_models(cache_dir=str(tmp_path), train_steps=0)
    ref_model = get_model(_cfg(paths.target, "float32", "TORCH_MLA"))
    ref_a, ref_b = _paged(ref_model, torch.float32, "TORCH_MLA")
    fi_model = get_model(_cfg(paths.target, "bfloat16", "FLASHINFER_MLA"))
    fi_a, fi_b = _paged(fi_model, torch.bfloat16, "FLASHINFER_MLA")
    # bf16 weights + activations over 3 layers: a few percent of the logit scale at most
    assert _rel(fi_a, ref_a) < 5e-2 and _rel(fi_b, ref_b) < 5e-2
    agree = (fi_a.argmax(-1) == ref_a.argmax(-1)).float().mean().item()
    assert agree > 0.9


@pytest.mark.gpu
def test_flashinfer_dspark_block_tracks_torch_mla(tmp_path):
    pytest.importorskip("flashinfer")
    paths = write_tiny_models(cache_dir=str(tmp_path), train_steps=0)
    prompt = [(3 * i + 17) % 256 for i in range(37)]
    outs = {}
    for backend, dtype, name in (("TORCH_MLA", torch.float32, "float32"), ("FLASHINFER_MLA", torch.bfloat16, "bfloat16")):
        target = get_model(_cfg(paths.target, name, backend))
        draft = get_draft_model(_cfg(paths.target, name, backend, paths.dspark, "dspark"), target)
        with torch.no_grad(), dense_attention_context():
            _, aux = target(torch.tensor(prompt, device="cuda"), torch.arange(len(prompt), device="cuda"),
                            aux_hidden_state_layers=draft.target_layer_ids)
        runner = PagedRunner(draft, block_size=16, num_blocks=16, dtype=dtype, device="cuda", backend=backend)
        q = draft.block_size
        req = PagedRequest(prompt + [9] + [MASK_ID] * (q - 1), chunks=[])
        md, _, pos, _ = runner.build_metadata([(req, len(prompt))], causal=True)
        with torch.no_grad(), set_forward_context({n: md for n in runner.layers}):
            draft.precompute_context_kv(aux, pos)
        req.num_computed = len(prompt)
        md, ids, pos, _ = runner.build_metadata([(req, q)], causal=False)
        with torch.no_grad(), set_forward_context({n: md for n in runner.layers}):
            outs[backend] = draft.compute_logits(draft(ids, pos)).float().cpu()
    assert _rel(outs["FLASHINFER_MLA"], outs["TORCH_MLA"]) < 5e-2
