"""ContextKVWriter (model_executor/layers/attention/mla_context_kv_writer.py): a block drafter's
context-KV write for all its layers as one GEMM over the stacked kv_a weights and one launch.
CPU: where it refuses (each reason by name) and the flag. Under Triton's interpreter (CPU) the
writer equals the per-layer path: tests/v1/attention/test_mla_context_kv.py. GPU: the same
against the per-layer path in bf16, eager and captured."""
import pytest
import torch

from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention.mla_context_kv_writer import (ENV_FLAG, ContextKVWriter,
                                                                        fused_context_kv_enabled)
from vllm.model_executor.models.dflash_mla import DFlashMLAForCausalLM
from vllm.model_executor.models.tiny import tiny_dflash_config, tiny_target_config
from vllm.transformers_utils.config import HFConfig

from tests.utils.context_kv_writes import bind_caches, per_layer_context_kv, write_only_entries


def _drafter(num_layers=2, device="cpu", dtype=torch.float32, seed=0):
    model = DFlashMLAForCausalLM(hf_config=HFConfig(tiny_dflash_config(tiny_target_config(),
                                                                       num_layers=num_layers)))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    model = model.to(device=device)
    for param in model.parameters():  # the weights in `dtype`; rope tables stay float32 as
        param.data = param.data.to(dtype)  # the loader builds them (_default_dtype)
    return model


def _features(model, tokens=4, device="cpu", dtype=torch.float32):
    return torch.zeros(tokens, model.config.hidden_size, device=device, dtype=dtype)


def test_off_cuda_it_is_not_used_and_says_why():
    model = _drafter()
    writer = ContextKVWriter([layer.self_attn for layer in model.model.layers])
    assert not writer.usable(_features(model))
    assert writer.reason == "not CUDA with Triton"


def test_the_flag_turns_it_off_and_a_bad_value_is_refused(monkeypatch):
    model = _drafter()
    attns = [layer.self_attn for layer in model.model.layers]
    monkeypatch.setenv(ENV_FLAG, "0")
    writer = ContextKVWriter(attns, cuda_only=False)
    assert not writer.usable(_features(model)) and writer.reason == f"{ENV_FLAG}=0"
    monkeypatch.setenv(ENV_FLAG, "yes")
    with pytest.raises(ValueError, match=f"{ENV_FLAG}='yes' is invalid"):
        fused_context_kv_enabled()
    monkeypatch.setenv(ENV_FLAG, "1")
    assert fused_context_kv_enabled()


@pytest.mark.parametrize("change,reason", [
    (lambda attns: setattr(attns[1].kv_a_proj_with_mqa, "quant_method", object()),
     "a quantised kv_a projection"),
    (lambda attns: setattr(attns[0].kv_a_layernorm, "variance_epsilon", 1e-5),
     "norms with different eps"),
    (lambda attns: attns[1].kv_a_layernorm.to(torch.float64), "norm weight dtype"),
    (lambda attns: setattr(attns[1].rotary_emb, "interleaved", not attns[1].rotary_emb.interleaved),
     "different ropes"),
    (lambda attns: setattr(attns[1].rotary_emb, "cos_cache", attns[1].rotary_emb.cos_cache * 1.5),
     "different rope tables"),
])
def test_layers_it_cannot_fuse_exactly_keep_the_per_layer_path(change, reason):
    model = _drafter()
    attns = [layer.self_attn for layer in model.model.layers]
    before = [a.kv_a_proj_with_mqa.weight for a in attns]
    change(attns)
    writer = ContextKVWriter(attns, cuda_only=False)
    assert not writer.usable(_features(model))
    assert reason in writer.reason
    # nothing was stacked: every layer keeps its own weight tensor
    assert [a.kv_a_proj_with_mqa.weight.data_ptr() for a in attns] == [w.data_ptr() for w in before]


def _write_both(model, aux, pos, slots, graph=False):
    """(per-layer caches, fused caches) of one context-KV write of `aux` at `pos`."""
    attns = [layer.self_attn for layer in model.model.layers]
    per_layer = bind_caches(attns, 8, 16, aux)
    per_layer_context_kv(model, attns, aux, pos, slots)
    fused = bind_caches(attns, 8, 16, aux)
    with set_forward_context(write_only_entries(attns, slots)):
        model.precompute_context_kv(aux, pos)  # eager: builds the stack
        if graph:
            for c in fused:
                c.fill_(7.0)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                model.precompute_context_kv(aux, pos)
            for c in fused:
                c.fill_(7.0)
            g.replay()
    torch.cuda.synchronize()
    return per_layer, fused


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("num_layers", [2, 5])
def test_fused_write_matches_the_per_layer_path_on_gpu(num_layers, graph):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device, dtype = "cuda", torch.bfloat16
    model = _drafter(num_layers, device, dtype, seed=num_layers)
    gen = torch.Generator().manual_seed(1)
    tokens = 24
    aux = (torch.randn(tokens, model.model.fc.weight.shape[1], generator=gen)).to(device, dtype)
    pos = torch.randint(0, 4000, (tokens,), generator=gen).to(device)
    slots = [torch.randperm(8 * 16, generator=gen)[:tokens].to(device) for _ in range(num_layers)]
    slots[0][3] = -1
    slots[-1] = slots[-1][:20]  # the last tokens of one layer have no slot
    per_layer, fused = _write_both(model, aux, pos, slots, graph=graph)
    writer = model.__dict__["_context_kv_writer"]
    assert writer.reason is None, writer.reason
    for a, b in zip(per_layer, fused):
        # the stacked GEMM may reduce in another order than the per-layer GEMMs: one bf16 ulp
        torch.testing.assert_close(b.float(), a.float(), rtol=1.6e-2, atol=1.6e-2)
        assert torch.equal(b == 7.0, a == 7.0)  # the same rows written, the same skipped
    exact = all(torch.equal(a, b) for a, b in zip(per_layer, fused))
    print(f"fused context-KV write bit-identical to the per-layer path: {exact}")
