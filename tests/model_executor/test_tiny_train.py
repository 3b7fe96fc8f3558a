"""The plain-torch training forwards (tiny_train) against the engine's own modules: the tiny
weights are trained and distilled with them, so they must compute what the engine serves.

Oracles: the engine's DeepseekV3ForCausalLM (full-sequence logits, residual streams, greedy
decoding by recomputation); the engine's EAGLE/MTP drafter run as the speculator runs it (each
draft step appended to one causal sequence); the engine's DFlash/DSpark drafter through a paged
TORCH_MLA cache (context KV precomputed, then the non-causal block)."""
import pytest
import torch
from safetensors.torch import load_file

from tests.utils.paged_harness import PagedRequest, PagedRunner
from vllm.config import ModelConfig, SpeculativeConfig, VllmConfig
from vllm.forward_context import dense_attention_context, set_forward_context
from vllm.model_executor.model_loader import get_draft_model, get_model
from vllm.model_executor.models import tiny, tiny_train as tt


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    paths = tiny.write_tiny_models(cache_dir=str(tmp_path_factory.mktemp("tiny")), seed=3, train_steps=0)
    configs = tiny.tiny_family_configs(shipped=False)
    weights = {n: load_file(f"{getattr(paths, n)}/model.safetensors") for n in configs}
    return paths, configs, weights


def _config(target_dir, method=None, draft_dir=None):
    spec = None if method is None else SpeculativeConfig(method=method, model=draft_dir, num_speculative_tokens=3)
    return VllmConfig(model_config=ModelConfig(model=target_dir, dtype="float32", device="cpu",
                                               attention_backend="TORCH_MLA"), speculative_config=spec)


@pytest.fixture(scope="module")
def engine_target(family):
    return get_model(_config(family[0].target))


def test_target_forward_matches_engine(family, engine_target):
    _, configs, weights = family
    cfg = configs["target"][0]
    ids = torch.randint(0, 260, (2, 23), generator=torch.Generator().manual_seed(1))
    tables = tt.rope_tables(cfg, 64)
    with torch.no_grad(), dense_attention_context():
        hidden, aux = tt.target_forward(weights["target"], cfg, ids, tables, aux_layers=(0, 2))
        logits = tt.lm_logits(weights["target"], hidden)
        for b in range(2):
            ref_h, ref_aux = engine_target(ids[b], torch.arange(23), aux_hidden_state_layers=(0, 2))
            torch.testing.assert_close(logits[b], engine_target.compute_logits(ref_h), rtol=1e-4, atol=1e-4)
            ref_0, ref_2 = ref_aux.split(cfg["hidden_size"], dim=-1)
            torch.testing.assert_close(aux[0][b], ref_0, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(aux[2][b], ref_2, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_cached_generation_matches_recomputation(family, engine_target, temperature):
    _, configs, weights = family
    cfg = configs["target"][0]
    prompts = torch.tensor([[72, 101, 108, 108, 111], [100, 101, 102, 32, 102]])
    gen = torch.Generator().manual_seed(5)
    out = tt.generate(weights["target"], cfg, prompts, 7, tt.rope_tables(cfg, 32), temperature=temperature,
                      generator=gen)
    assert out.shape == (2, 12) and torch.equal(out[:, :5], prompts)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad(), dense_attention_context():
        seqs = prompts.clone()
        for _ in range(7):  # batch-wise recomputation with the engine, same sampling stream
            logits = torch.stack([engine_target.compute_logits(engine_target(s, torch.arange(len(s))))[-1, :256]
                                  for s in seqs])
            nxt = (logits.argmax(-1) if temperature == 0 else
                   torch.multinomial((logits / temperature).softmax(-1), 1, generator=gen)[:, 0])
            seqs = torch.cat([seqs, nxt[:, None]], 1)
    assert torch.equal(out, seqs)


@pytest.mark.parametrize("method", ["eagle", "mtp"])
def test_unrolled_ar_drafter_matches_engine_draft_chain(family, engine_target, method):
    paths, configs, weights = family
    cfg = configs[method][0]
    draft = get_draft_model(_config(paths.target, method, getattr(paths, method)), engine_target)
    t = 12
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 256, (t,), generator=gen)
    hidden = torch.randn(t, cfg["hidden_size"], generator=gen)  # stands in for the target's
    outs = tt.ar_drafter_forward(method, weights[method], cfg, weights["target"], ids[None], hidden[None],
                                 tt.rope_tables(cfg, 32), num_passes=3)
    checked = 0
    with torch.no_grad(), dense_attention_context():
        for s in range(3):
            for p in (s, s + 2, t - 2):
                a = p - s + 1  # the anchor this draft step belongs to
                chain_ids, chain_h = ids[1:a + 1], hidden[:a]
                for j in range(1, s + 1):  # draft step j: next token, the drafter's own pre-norm hidden
                    _, pre = draft(chain_ids, torch.arange(len(chain_ids)), chain_h)
                    chain_ids = torch.cat([chain_ids, ids[a + j:a + j + 1]])
                    chain_h = torch.cat([chain_h, pre[-1:]])
                normed, _ = draft(chain_ids, torch.arange(len(chain_ids)), chain_h)
                assert len(chain_ids) == p + 1
                torch.testing.assert_close(outs[s][0, p], normed[-1], rtol=1e-4, atol=1e-4)
                checked += 1
    assert checked == 9


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_block_drafter_forward_matches_paged_engine(family, engine_target, method):
    paths, configs, weights = family
    cfg = configs[method][0]
    draft = get_draft_model(_config(paths.target, method, getattr(paths, method)), engine_target)
    seq = [(5 * i + 40) % 256 for i in range(16)]
    layer_ids = tuple(cfg["target_layer_ids"])
    with torch.no_grad(), dense_attention_context():
        _, aux = engine_target(torch.tensor(seq), torch.arange(16), aux_hidden_state_layers=layer_ids)
    aux_cat = aux  # [16, J * hidden]: the tapped streams side by side
    q = 5
    anchors = torch.tensor([[3, 9]])
    block = torch.full((1, 2, q), tiny.MASK_ID)
    block[0, :, 0] = torch.tensor([seq[3], seq[9]])
    with torch.no_grad(), dense_attention_context():
        mine = tt.block_drafter_forward(weights[method], cfg, weights["target"], aux_cat[None], anchors, block,
                                        tt.rope_tables(cfg, 32))
    for n, a in enumerate(anchors[0].tolist()):
        runner = PagedRunner(draft, block_size=4, num_blocks=16)
        req = PagedRequest(seq[:a] + block[0, n].tolist(), chunks=[])
        md, _, ctx_pos, _ = runner.build_metadata([(req, a)], causal=True)
        with torch.no_grad(), set_forward_context({name: md for name in runner.layers}):
            draft.precompute_context_kv(aux_cat[:a], ctx_pos)
        req.num_computed = a
        md, block_ids, block_pos, _ = runner.build_metadata([(req, q)], causal=False)
        with torch.no_grad(), set_forward_context({name: md for name in runner.layers}):
            ref = draft(block_ids, block_pos)
        torch.testing.assert_close(mine[0, n], ref, rtol=1e-4, atol=1e-4)
    if method == "dspark":
        prev = torch.tensor([0, 65, 259])
        torch.testing.assert_close(tt.markov_bias(weights[method], prev), draft.markov_logits_bias(prev))


def test_unrolled_mask_first_pass_is_causal():
    m = tt.unrolled_mask(3, 5)
    assert torch.equal(m[:5, :5], torch.tril(torch.ones(5, 5, dtype=torch.bool)))
    assert not m[:5, 5:].any()  # pass 1 never sees later passes
    # pass 3 at position 4 (anchor 2): pass-1 keys 0..2, pass-2 key 3, pass-3 key 4
    row = m[2 * 5 + 4].view(3, 5)
    assert row[0].tolist() == [True, True, True, False, False]
    assert row[1].tolist() == [False, False, False, True, False]
    assert row[2].tolist() == [False, False, False, False, True]


def test_unsupported_config_is_named():
    with pytest.raises(ValueError, match="rope_scaling"):
        tt.check_supported(tiny.tiny_target_config(rope_scaling=tiny.yarn_rope_scaling()))
