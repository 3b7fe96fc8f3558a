"""MLA prefill attention (backends/mla/prefill.py) on CPU against a float64 dense oracle:
new tokens causal over themselves + cached context read from the paged latent cache in bounded
passes, merged by LSE; the memory bound; DCP-sharded context merged across simulated ranks."""
import pytest
import torch

from tests.utils.mla_prefill_helpers import (NOPE, R, build_prefill_rank, fake_layer,
                                             make_prefill_case, reference_prefill)
from vllm.v1.attention.backends.mla import prefill as prefill_mod
from vllm.v1.attention.backends.mla.prefill import (context_attention_torch, forward_mla_prefill,
                                                    self_attention_torch)
from vllm.v1.attention.ops.dcp_combine import merge_attn_states

# (context_lens, query_lens): fresh prompts, short and long contexts, 1-token chunks, a row
# whose context is exactly one pass, and mixed batches.
CASES = {
    "fresh": ([0, 0], [5, 9]),
    "one_request_context": ([37], [6]),
    "mixed": ([0, 13, 40, 1], [7, 3, 12, 2]),
    "single_token_queries": ([8, 29], [1, 1]),
    "context_equals_chunk": ([16, 32], [4, 16]),
}
CHUNKS = [1, 5, 16, 1000]


def run_dcp1(case, chunk, block_size=4):
    meta, cache = build_prefill_rank(case, chunk=chunk, block_size=block_size)
    c_kv, k_pe = case.new_tokens()
    layer = fake_layer(case.w_kv_b, case.scale, cache)
    out = forward_mla_prefill(layer, case.q[..., :NOPE], case.q[..., NOPE:], c_kv, k_pe, meta)
    return out, meta


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_prefill_with_context_matches_dense_float64(name, chunk):
    case = make_prefill_case(*CASES[name], seed=len(name) + chunk)
    out, _ = run_dcp1(case, chunk)
    ref, _ = reference_prefill(case)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_context_passes_cover_every_context_token_once_within_the_chunk_bound():
    case = make_prefill_case([0, 13, 40, 1], [7, 3, 12, 2], seed=1)
    meta, _ = build_prefill_rank(case, chunk=6)
    assert meta.has_context and meta.context_lens_cpu.tolist() == [0, 13, 40, 1]
    seen = {i: [] for i in range(4)}
    for chunk in meta.context_chunks:
        assert chunk.num_tokens <= 6
        assert chunk.cu_lens_cpu.tolist()[-1] == chunk.num_tokens == chunk.slots.numel()
        for i in range(4):
            s, n = int(chunk.starts_cpu[i]), int(chunk.lens_cpu[i])
            seen[i] += list(range(s, s + n))
    assert {i: sorted(v) for i, v in seen.items()} == {i: list(range(c)) for i, c in
                                                       enumerate([0, 13, 40, 1])}
    assert len(meta.context_chunks) == -(-54 // 6)


def test_no_score_tile_exceeds_chunk_by_query_and_no_gather_exceeds_chunk(monkeypatch):
    """The memory bound: every score tensor is [H, Tq, Tk] with Tk <= chunk (so at most
    chunk x L per head), every gathered latent block holds <= chunk tokens."""
    chunk = 7
    case = make_prefill_case([60, 0, 25], [30, 20, 9], seed=4)
    tiles, gathers = [], []
    real_attend, real_expand = prefill_mod._attend, prefill_mod.expand_latent

    def recording_attend(q, k, v, scale, mask=None):
        tiles.append((q.shape[0], k.shape[0]))
        return real_attend(q, k, v, scale, mask)

    def recording_expand(c_kv, k_pe, w, nope):
        gathers.append(c_kv.shape[0])
        return real_expand(c_kv, k_pe, w, nope)

    monkeypatch.setattr(prefill_mod, "_attend", recording_attend)
    monkeypatch.setattr(prefill_mod, "expand_latent", recording_expand)
    out, _ = run_dcp1(case, chunk)
    torch.testing.assert_close(out, reference_prefill(case)[0], rtol=1e-10, atol=1e-10)
    longest = max(c + m for c, m in zip(case.context_lens, case.query_lens))
    assert tiles and max(k for _, k in tiles) <= chunk
    assert max(q * k for q, k in tiles) <= chunk * longest
    # the first expansion is the step's own new tokens (in hand); the rest are context passes
    assert max(gathers[1:]) <= chunk and len(gathers) == 1 + -(-85 // chunk)


def test_self_part_and_context_part_have_correct_lse():
    case = make_prefill_case([21], [6], seed=9)
    meta, cache = build_prefill_rank(case, chunk=4)
    q = case.q
    c_kv, k_pe = case.new_tokens()
    k, v = prefill_mod.expand_latent(c_kv, k_pe, case.w_kv_b, NOPE)
    o_self, lse_self = self_attention_torch(q, k, v, meta, case.scale)
    o_ctx, lse_ctx = context_attention_torch(q, cache, case.w_kv_b, meta, case.scale, R, NOPE)
    out, lse = merge_attn_states(torch.stack([o_self, o_ctx]), torch.stack([lse_self, lse_ctx]))
    ref, ref_lse = reference_prefill(case)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("interleave", [1, 4])
@pytest.mark.parametrize("n", [2, 4])
def test_dcp_sharded_context_merged_across_ranks_equals_dcp1(n, interleave):
    """Each simulated rank attends only its own context shard (nothing else is in its cache:
    other slots are NaN); the partials merge by LSE; the self part needs no communication."""
    # context 1 on N=4: ranks 1..3 store nothing of it (empty shard -> LSE -inf, O = 0)
    case = make_prefill_case([0, 1, 19, 45], [6, 3, 8, 5], num_heads=4, seed=n + interleave)
    c_kv, k_pe = case.new_tokens()
    k, v = prefill_mod.expand_latent(c_kv, k_pe, case.w_kv_b, NOPE)
    outs, lses = [], []
    for rank in range(n):
        meta, cache = build_prefill_rank(case, n=n, rank=rank, interleave=interleave,
                                         block_size=4, chunk=5)
        expected_local = [sum(1 for t in range(c) if (t // interleave) % n == rank)
                          for c in case.context_lens]
        assert meta.local_context_lens_cpu.tolist() == expected_local
        assert meta.has_context  # decided on global lengths: the same on every rank
        o, l = context_attention_torch(case.q, cache, case.w_kv_b, meta, case.scale, R, NOPE)
        outs.append(o)
        lses.append(l)
        if rank == 0:
            o_self, lse_self = self_attention_torch(case.q, k, v, meta, case.scale)
    o_ctx, lse_ctx = merge_attn_states(torch.stack(outs), torch.stack(lses))
    out, _ = merge_attn_states(torch.stack([o_self, o_ctx]), torch.stack([lse_self, lse_ctx]))
    dcp1, _ = run_dcp1(case, chunk=5)
    torch.testing.assert_close(out, dcp1, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out, reference_prefill(case)[0], rtol=1e-10, atol=1e-10)


def test_float32_inputs_stay_close_to_the_float64_oracle():
    case64 = make_prefill_case([50, 3], [10, 4], seed=2)
    case32 = make_prefill_case([50, 3], [10, 4], seed=2, dtype=torch.float32)
    out, _ = run_dcp1(case32, chunk=8)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference_prefill(case64)[0], rtol=1e-4, atol=1e-4)


def test_device_seq_lens_without_host_twin_is_a_clear_error():
    case = make_prefill_case([4], [3], seed=0)
    with pytest.raises(ValueError, match="seq_lens_cpu"):
        build_prefill_rank(case, device="meta", host_twins=False)


def test_metadata_covering_other_tokens_is_rejected():
    case = make_prefill_case([4], [3], seed=0)
    meta, cache = build_prefill_rank(case)
    c_kv, k_pe = case.new_tokens()
    layer = fake_layer(case.w_kv_b, case.scale, cache)
    with pytest.raises(ValueError, match="covers 3 tokens, got 2"):
        forward_mla_prefill(layer, case.q[:2, :, :NOPE], case.q[:2, :, NOPE:], c_kv[:2],
                            k_pe[:2], meta)


@pytest.mark.parametrize("n,interleave", [(1, 1), (2, 4)])
def test_flashinfer_path_plans_and_masks_on_a_recording_fake(monkeypatch, n, interleave):
    """The FlashInfer path's call geometry, checked on CPU with a brute-force fake of the ragged
    wrapper: causal plan over the new tokens, one non-causal plan per context pass with the
    pass's kv indptr, base-2 LSE converted, rows without context in a pass pinned to -inf."""
    from tests.utils.fake_flashinfer import FakeBatchPrefillWithRaggedKVCacheWrapper
    from vllm.v1.attention.backends.mla.prefill import (FlashInferPrefillState,
                                                        context_attention_flashinfer,
                                                        self_attention_flashinfer)
    case = make_prefill_case([0, 11, 30], [5, 4, 6], seed=21)
    c_kv, k_pe = case.new_tokens()
    k, v = prefill_mod.expand_latent(c_kv, k_pe, case.w_kv_b, NOPE)
    fakes = []

    def fake_wrapper(self):
        index = len(self._plans)
        while len(self._pool) <= index:
            fakes.append(FakeBatchPrefillWithRaggedKVCacheWrapper())
            self._pool.append(fakes[-1])
        return self._pool[index]

    monkeypatch.setattr(FlashInferPrefillState, "_wrapper", fake_wrapper)
    outs, lses = [], []
    for rank in range(n):
        meta, cache = build_prefill_rank(case, n=n, rank=rank, interleave=interleave, chunk=8)
        meta.backend, meta.backend_state = "flashinfer", FlashInferPrefillState(torch.device("cpu"))
        meta.backend_state.begin_step(meta)
        assert any(c.token_has_kv is not None for c in meta.context_chunks)
        o, l = context_attention_flashinfer(case.q, cache, case.w_kv_b, meta, case.scale, R,
                                            NOPE)
        assert not torch.isnan(o).any()
        outs.append(o)
        lses.append(l)
        if rank == 0:
            o_s, l_s = self_attention_flashinfer(case.q, k, v, meta, case.scale)
            first = fakes[-1].plans[-1]
            assert first["causal"] is True and first["head_dim_qk"] == NOPE + 64
            assert first["head_dim_vo"] == 128 and first["num_qo_heads"] == case.num_heads
    context_plans = [p for f in fakes for p in f.plans if not p["causal"]]
    assert context_plans and all(p["qo_indptr"].tolist() == [0, 5, 9, 15] for p in context_plans)
    o_ctx, l_ctx = merge_attn_states(torch.stack(outs), torch.stack(lses))
    out, lse = merge_attn_states(torch.stack([o_s, o_ctx]), torch.stack([l_s, l_ctx]))
    ref, ref_lse = reference_prefill(case)
    # the LSEs travel in float32 (as FlashInfer's do): float32-level agreement
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_torch_path_tiles_queries_and_keys(monkeypatch):
    """With a small torch tile every score tensor is at most tile x tile per head, whatever the
    context pass size, and the result is unchanged."""
    monkeypatch.setattr(prefill_mod, "TORCH_TILE_TOKENS", 3)
    tiles = []
    real_attend = prefill_mod._attend

    def recording_attend(q, k, v, scale, mask=None):
        tiles.append((q.shape[0], k.shape[0]))
        return real_attend(q, k, v, scale, mask)

    monkeypatch.setattr(prefill_mod, "_attend", recording_attend)
    case = make_prefill_case([0, 13, 40, 1], [7, 3, 12, 2], seed=8)
    out, _ = run_dcp1(case, chunk=1000)
    torch.testing.assert_close(out, reference_prefill(case)[0], rtol=1e-10, atol=1e-10)
    assert max(q for q, _ in tiles) <= 3 and max(k for _, k in tiles) <= 3


def test_flashinfer_prefill_serves_deepseek_dims_in_half_precision_only():
    serves = prefill_mod._flashinfer_serves
    assert serves(192, 128, torch.bfloat16) and serves(192, 128, torch.float16)
    # the tiny model's dims and float32 take the torch path (with a one-time warning)
    assert not serves(96, 32, torch.bfloat16)
    assert not serves(192, 128, torch.float32)
