"""The four drafters: load from their own directories (tiny models), forward contracts checked
against weights read straight from the safetensors files, DFlash/DSpark context-KV precompute +
non-causal paged block attention vs a dense reference, and refusal of targets they do not fit."""

import copy

import pytest
import torch
from safetensors.torch import load_file

from tests.utils.paged_harness import PagedRequest, PagedRunner
from vllm.config import ModelConfig, SpeculativeConfig, VllmConfig
from vllm.forward_context import dense_attention_context, set_forward_context
from vllm.model_executor.model_loader import get_draft_model, get_model
from vllm.model_executor.models.tiny import MASK_ID, write_random_target, write_tiny_models


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_models(cache_dir=str(tmp_path_factory.mktemp("tiny")), seed=0, train_steps=0)


def _config(target_dir, method=None, draft_dir=None):
    spec = None if method is None else SpeculativeConfig(method=method, model=draft_dir, num_speculative_tokens=3)
    return VllmConfig(model_config=ModelConfig(model=target_dir, dtype="float32", device="cpu",
                                               attention_backend="TORCH_MLA"), speculative_config=spec)


@pytest.fixture(scope="module")
def target(tiny):
    return get_model(_config(tiny.target))


def _draft(tiny, target, method):
    return get_draft_model(_config(tiny.target, method, getattr(tiny, method)), target)


def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _capture_input(module):
    seen = {}
    handle = module.register_forward_hook(lambda m, args, out: seen.setdefault("hidden", args[1]))
    return seen, handle


@pytest.mark.parametrize("taps", [(0, 2), (2, 0, 2), (1,), (0, 1, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tapped_streams_equal_hidden_plus_residual_after_each_layer(target, taps, dtype):
    """The target's aux output [T, J * D] holds, side by side in layer order (duplicates once),
    the residual stream after each tapped layer: bit for bit `hidden + residual` of a
    layer-by-layer run (the norms that compute the sums anyway write them in place)."""
    target = copy.deepcopy(target).to(dtype)  # the module fixture stays float32 for the others
    model = target.model
    ids = torch.tensor([3, 250, 17, 99, 5, 64, 128])
    pos = torch.arange(len(ids))
    with torch.no_grad(), dense_attention_context():
        hidden, aux = target(ids, pos, aux_hidden_state_layers=taps)
        h, r, streams = model.embed_tokens(ids), None, {}
        for i, layer in enumerate(model.layers):
            h, r = layer(pos, h, r)
            streams[i] = h + r
        ref_hidden = model.norm(h, r)[0]
        untapped = target(ids, pos)
    width = model.embed_tokens.weight.shape[1]
    order = sorted(set(taps))
    assert aux.shape == (len(ids), len(order) * width) and aux.dtype == dtype
    for j, i in enumerate(order):
        assert torch.equal(aux[:, j * width:(j + 1) * width], streams[i]), (taps, i)
    assert torch.equal(hidden, ref_hidden) and torch.equal(untapped, hidden)


def test_tapping_adds_no_sum_or_concatenation_ops(target):
    """What tapping costs the target forward, op by op (CPU): the aux buffer's allocation and,
    on the torch path, one copy of each norm's sum into its slice; no elementwise add and no
    concatenation (on CUDA the fused norm kernel writes the slice itself, so not even the
    copies). Before, each tap was an add and the runner concatenated them."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func.overloadpacket.__name__)] += 1
            return func(*args, **(kwargs or {}))

    ids, pos = torch.tensor([3, 250, 17, 99]), torch.arange(4)
    taps = (0, 1, 2)
    counts = {}
    for name, layers in (("plain", ()), ("tapped", taps)):
        with torch.no_grad(), dense_attention_context(), Count() as mode:
            target(ids, pos, aux_hidden_state_layers=layers)
        counts[name] = mode.ops
    extra = counts["tapped"] - counts["plain"]
    assert counts["tapped"]["add"] == counts["plain"]["add"], extra
    assert counts["tapped"]["cat"] == counts["plain"]["cat"], extra
    assert set(extra) <= {"new_empty", "empty", "copy_", "slice"}, extra
    assert extra["copy_"] <= len(taps) and extra["new_empty"] + extra["empty"] == 1, extra


@pytest.mark.parametrize("method", ["eagle", "mtp"])
def test_autoregressive_drafter_contract(tiny, target, method):
    draft = _draft(tiny, target, method)
    weights = load_file(f"{getattr(tiny, method)}/model.safetensors")
    embed = load_file(f"{tiny.target}/model.safetensors")["model.embed_tokens.weight"]
    ids, pos = torch.tensor([5, 77, 200, 31]), torch.tensor([0, 1, 2, 3])
    hidden = torch.randn(4, 256, generator=torch.Generator().manual_seed(0))
    if method == "eagle":
        layer, fc = draft.model.layers[0], weights["model.fc.weight"]
        en, hn = weights["model.enorm.weight"], weights["model.hnorm.weight"]
        final_norm = weights["model.norm.weight"]
        e = embed[ids]
    else:
        layer, fc = draft.model.layers["3"], weights["model.layers.3.eh_proj.weight"]
        en, hn = weights["model.layers.3.enorm.weight"], weights["model.layers.3.hnorm.weight"]
        final_norm = weights["model.layers.3.shared_head.norm.weight"]
        e = embed[ids] * (pos != 0).unsqueeze(-1)  # DeepSeek MTP zeroes position 0's embedding
    seen, handle = _capture_input(layer.self_attn)
    with torch.no_grad(), dense_attention_context():
        for_logits, for_next = draft(ids, pos, hidden)
    handle.remove()
    expected_in = torch.cat([_rms(e, en), _rms(hidden, hn)], dim=-1) @ fc.T
    normed_in = _rms(expected_in, weights[[k for k in weights if k.endswith("input_layernorm.weight")][0]])
    torch.testing.assert_close(seen["hidden"], normed_in, rtol=1e-4, atol=1e-4)
    assert for_logits.shape == for_next.shape == (4, 256)
    torch.testing.assert_close(for_logits, _rms(for_next, final_norm), rtol=1e-5, atol=1e-5)
    lm_head = load_file(f"{tiny.target}/model.safetensors")["lm_head.weight"]
    torch.testing.assert_close(draft.compute_logits(for_logits), for_logits @ lm_head.T, rtol=1e-4, atol=1e-4)
    assert all(not m.non_causal for m in draft.modules() if hasattr(m, "non_causal"))


def _dense_block_reference(draft, features, ctx_pos, block_ids, block_pos):
    """Block hidden states with plain dense attention: every block row sees all context latents
    (from the projected target features) and all block latents. Built from the submodules'
    projections, with its own attention math (expanded K/V, float64 softmax)."""
    x = draft.get_input_embeddings(block_ids)
    for layer in draft.model.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q_nope, q_pe = attn.project_q(block_pos, h)
        c_ctx, pe_ctx = attn.rotated_latent_kv(ctx_pos, features)
        c_blk, pe_blk = attn.rotated_latent_kv(block_pos, h)
        q_pe, _ = attn.rotary_emb(block_pos, q_pe, pe_blk)
        c_all, pe_all = torch.cat([c_ctx, c_blk]), torch.cat([pe_ctx, pe_blk])
        kv = (c_all.double() @ attn.kv_b_proj.weight.double().T).view(len(c_all), attn.num_local_heads, -1)
        k_nope, v = kv[..., :attn.qk_nope_head_dim], kv[..., attn.qk_nope_head_dim:]
        scores = (torch.einsum("qhd,khd->hqk", q_nope.double(), k_nope)
                  + torch.einsum("qhd,kd->hqk", q_pe.double(), pe_all.double())) * attn.scaling
        o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float().reshape(len(block_ids), -1)
        x = x + attn.o_proj(o)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return draft.model.norm(x)


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_block_drafter_paged_matches_dense_reference(tiny, target, method):
    draft = _draft(tiny, target, method)
    layer_ids = draft.target_layer_ids
    assert all(layer.self_attn.get_kv_cache_spec(16, torch.float32).non_causal_multi_token_decode
               for layer in draft.model.layers)
    prompt = [(3 * i + 17) % 256 for i in range(11)]
    L, Q = len(prompt), draft.block_size
    with torch.no_grad(), dense_attention_context():
        _, aux = target(torch.tensor(prompt), torch.arange(L), aux_hidden_state_layers=layer_ids)
    aux_cat = aux  # [L, J * hidden]: the tapped streams side by side
    runner = PagedRunner(draft, block_size=4, num_blocks=16)
    req = PagedRequest(prompt + [9] + [MASK_ID] * (Q - 1), chunks=[])
    md, _, ctx_pos, _ = runner.build_metadata([(req, L)], causal=True)
    with torch.no_grad(), set_forward_context({name: md for name in runner.layers}):
        draft.precompute_context_kv(aux_cat, ctx_pos)
    req.num_computed = L
    md, block_ids, block_pos, _ = runner.build_metadata([(req, Q)], causal=False)
    assert md.num_decode_tokens == Q and not md.causal
    with torch.no_grad(), set_forward_context({name: md for name in runner.layers}):
        hidden = draft(block_ids, block_pos)
        ref = _dense_block_reference(draft, draft.context_features(aux_cat), ctx_pos, block_ids, block_pos)
    torch.testing.assert_close(hidden, ref, rtol=1e-4, atol=1e-4)
    # the context features really are fc + norm of the concatenated taps (weights from the file)
    w = load_file(f"{getattr(tiny, method)}/model.safetensors")
    torch.testing.assert_close(draft.context_features(aux_cat),
                               _rms(aux_cat @ w["model.fc.weight"].T, w["model.hidden_norm.weight"]),
                               rtol=1e-4, atol=1e-4)


def test_dspark_markov_bias_is_low_rank_product(tiny, target):
    draft = _draft(tiny, target, "dspark")
    w = load_file(f"{tiny.dspark}/model.safetensors")
    prev = torch.tensor([0, 255, 259, 17])
    bias = draft.markov_logits_bias(prev)
    assert bias.shape == (4, 260)
    torch.testing.assert_close(bias, w["markov_head.w1.weight"][prev] @ w["markov_head.w2.weight"].T)


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_block_drafter_refuses_target_with_too_few_layers(tiny, tmp_path, method):
    short = str(tmp_path / "short")
    write_random_target(short, seed=1, num_hidden_layers=2)  # drafters tap layer 2
    bad_target = get_model(_config(short))
    with pytest.raises(ValueError, match=r"target_layer_ids.*num_hidden_layers=2"):
        get_draft_model(_config(short, method, getattr(tiny, method)), bad_target)


@pytest.mark.parametrize("method", ["eagle", "mtp", "dflash", "dspark"])
def test_drafter_refuses_target_with_other_hidden_size(tiny, tmp_path, method):
    narrow = str(tmp_path / "narrow")
    write_random_target(narrow, seed=1, hidden_size=128)
    bad_target = get_model(_config(narrow))
    with pytest.raises(ValueError, match=r"hidden_size=256.*hidden_size=128"):
        get_draft_model(_config(narrow, method, getattr(tiny, method)), bad_target)


def test_layer_names_do_not_collide(tiny, target):
    target_names = {m.layer_name for m in target.modules() if hasattr(m, "layer_name")}
    for method in ("eagle", "mtp", "dflash", "dspark"):
        names = {m.layer_name for m in _draft(tiny, target, method).modules() if hasattr(m, "layer_name")}
        assert names and not names & target_names
