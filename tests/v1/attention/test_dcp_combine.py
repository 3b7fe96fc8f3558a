"""LSE merge (NaN safety, base flag), q all-gather layout, KV cache write, prefill helper, selector."""
import math

import pytest
import torch

from tests.utils.mla_dcp_helpers import V_DIM
from vllm.distributed.parallel_state import get_dcp_group
from vllm.v1.attention.backends.mla.prefill import MLACommonPrefillMetadata, self_attention_torch
from vllm.v1.attention.ops.dcp_combine import (correct_attn_out, cp_lse_ag_out_rs,
                                               dcp_all_gather_q, merge_attn_states)
from vllm.v1.attention.ops.mla_kv_cache import concat_and_cache_mla
from vllm.v1.attention.selector import get_attn_backend


def split_softmax_case(n_ranks=3, tokens=5, heads=2, d=8, seed=0):
    """Full attention over random keys split into n disjoint chunks: partial (O, lse) per chunk
    plus the exact full answer computed directly."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(tokens, heads, 12 * n_ranks, generator=g, dtype=torch.float64) * 3
    values = torch.randn(12 * n_ranks, d, generator=g, dtype=torch.float64)
    full = torch.softmax(scores, -1) @ values
    full_lse = torch.logsumexp(scores, -1)
    outs, lses = [], []
    for chunk_s, chunk_v in zip(scores.chunk(n_ranks, -1), values.chunk(n_ranks)):
        outs.append(torch.softmax(chunk_s, -1) @ chunk_v)
        lses.append(torch.logsumexp(chunk_s, -1))
    return torch.stack(outs), torch.stack(lses), full, full_lse


def test_merge_is_exact_softmax():
    outs, lses, full, full_lse = split_softmax_case()
    out, lse = merge_attn_states(outs, lses)
    torch.testing.assert_close(out, full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, full_lse, rtol=1e-12, atol=1e-12)


def test_base2_flag_converts_and_wrong_base_corrupts():
    outs, lses, full, full_lse = split_softmax_case(seed=1)
    lses2 = lses / math.log(2.0)  # the same states in base 2
    out, lse2 = merge_attn_states(outs, lses2, lse_base_on_e=False)
    torch.testing.assert_close(out, full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse2 * math.log(2.0), full_lse, rtol=1e-12, atol=1e-12)
    wrong, _ = merge_attn_states(outs, lses2, lse_base_on_e=True)
    assert (wrong - full).abs().max() > 1e-3  # the flag matters


def test_nan_and_inf_lse_are_treated_as_empty():
    outs, lses, _, _ = split_softmax_case(n_ranks=3, seed=2)
    # rank 1 has no visible token: its O is garbage (NaN) and its LSE NaN / +inf
    outs[1] = float("nan")
    lses[1, 0] = float("nan")
    lses[1, 1:] = float("inf")
    out, lse = merge_attn_states(outs, lses)
    keep = torch.tensor([0, 2])
    ref, ref_lse = merge_attn_states(outs[keep], lses[keep])
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    for r in range(3):
        corrected, _ = correct_attn_out(outs[r], lses, r)
        assert not torch.isnan(corrected).any()


def test_all_empty_row_gives_zero_and_minus_inf():
    outs = torch.full((2, 1, 1, 4), float("nan"), dtype=torch.float64)
    lses = torch.full((2, 1, 1), float("-inf"), dtype=torch.float64)
    out, lse = merge_attn_states(outs, lses)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))
    corrected, lse_g = correct_attn_out(outs[0], lses, 0)
    assert torch.all(corrected == 0) and torch.all(lse_g == float("-inf"))


def test_single_rank_group_ops_are_identity():
    group = get_dcp_group()
    assert group.world_size == 1
    q = torch.randn(3, 4, 576)
    assert dcp_all_gather_q(q, group) is not None and torch.equal(dcp_all_gather_q(q, group), q)
    out, lse = torch.randn(3, 4, V_DIM), torch.randn(3, 4)
    assert cp_lse_ag_out_rs(out, lse, group) is out


def test_concat_and_cache_skips_pad_slots():
    cache = torch.zeros(3, 4, 576)
    kv_c, k_pe = torch.randn(4, 512), torch.randn(4, 64)
    slots = torch.tensor([5, -1, 0, 11])
    concat_and_cache_mla(kv_c, k_pe, cache, slots)
    flat = cache.view(-1, 576)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s], torch.cat([kv_c[i], k_pe[i]]))
    written = {5, 0, 11}
    untouched = [s for s in range(12) if s not in written]
    assert torch.all(flat[untouched] == 0)


def test_forward_prefill_is_causal_per_request():
    g = torch.Generator().manual_seed(3)
    lens = [3, 5]
    q = torch.randn(8, 2, 24, generator=g, dtype=torch.float64)
    k = torch.randn(8, 2, 24, generator=g, dtype=torch.float64)
    v = torch.randn(8, 2, 16, generator=g, dtype=torch.float64)
    qsl = torch.tensor([0, 3, 8], dtype=torch.int32)
    # key tiles of 2 tokens: the causal mask and the LSE merge across tiles are exercised
    meta = MLACommonPrefillMetadata(query_start_loc=qsl, seq_lens=torch.tensor(lens),
                                    max_query_len=5, query_start_loc_cpu=qsl,
                                    context_chunk_tokens=2)
    out, _ = self_attention_torch(q, k, v, meta, scale=0.3)
    start = 0
    for length in lens:
        for i in range(length):
            t = start + i
            s = torch.einsum("hd,khd->hk", q[t], k[start:t + 1]) * 0.3
            ref = torch.einsum("hk,khd->hd", torch.softmax(s, -1), v[start:t + 1])
            torch.testing.assert_close(out[t], ref, rtol=1e-12, atol=1e-12)
        start += length


def test_selector():
    assert get_attn_backend("TORCH_MLA").get_name() == "TORCH_MLA"
    assert get_attn_backend("flashinfer_mla").get_name() == "FLASHINFER_MLA"
    if not torch.cuda.is_available():
        assert get_attn_backend("auto").get_name() == "TORCH_MLA"
        assert get_attn_backend(None).get_name() == "TORCH_MLA"
    with pytest.raises(ValueError, match="TORCH_MLA"):
        get_attn_backend("FLASH_ATTN")
    assert get_attn_backend("TORCH_MLA").lse_base_on_e is True


def test_forward_context_scoping():
    from vllm.forward_context import (get_forward_context, is_forward_context_available,
                                      set_forward_context)
    assert not is_forward_context_available()
    with pytest.raises(RuntimeError, match="set_forward_context"):
        get_forward_context()
    with set_forward_context({"a": 1}, vllm_config="cfg"):
        assert get_forward_context().attn_metadata == {"a": 1}
        with set_forward_context({"b": 2}):
            assert get_forward_context().attn_metadata == {"b": 2}
        assert get_forward_context().attn_metadata == {"a": 1}
        assert get_forward_context().vllm_config == "cfg"
    assert not is_forward_context_available()
