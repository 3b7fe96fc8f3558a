import pytest
import torch
from hypothesis import given, settings, strategies as st

from vllm.v1.core.kv_cache_utils import (BlockPool, NoFreeBlocksError, get_kv_cache_config,
                                         get_num_blocks, group_layers_into_kv_cache_groups,
                                         num_virtual_blocks)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

AGREEMENT = "All attention layers in the same KV cache group must agree on non_causal_multi_token_decode"


def mla(non_causal=False, block_size=16, dtype=torch.bfloat16):
    return MLAAttentionSpec(block_size=block_size, dtype=dtype,
                            non_causal_multi_token_decode=non_causal)


def test_mla_page_size_and_defaults():
    spec = MLAAttentionSpec(16, dtype=torch.bfloat16)
    assert (spec.num_kv_heads, spec.head_size, spec.non_causal_multi_token_decode) == (1, 576, False)
    assert spec.page_size_bytes == 16 * 576 * 2
    assert MLAAttentionSpec(block_size=64, dtype=torch.float32).page_size_bytes == 64 * 576 * 4
    # Plain attention keeps separate K and V.
    assert FullAttentionSpec(16, 8, 128, torch.float16).page_size_bytes == 2 * 16 * 8 * 128 * 2


def test_merge_marked_and_unmarked():
    assert MLAAttentionSpec.merge([mla(True), mla(True)]).non_causal_multi_token_decode is True
    assert MLAAttentionSpec.merge([mla(False), mla(False)]).non_causal_multi_token_decode is False
    with pytest.raises(AssertionError, match=AGREEMENT):
        MLAAttentionSpec.merge([mla(False), mla(True)])
    with pytest.raises(AssertionError, match=AGREEMENT):
        MLAAttentionSpec.merge([mla(True), mla(False), mla(True)])
    with pytest.raises(AssertionError, match="block_size"):
        MLAAttentionSpec.merge([mla(block_size=16), mla(block_size=32)])


def test_target_and_dspark_draft_form_two_groups():
    specs = {f"model.layers.{i}.self_attn": mla(False) for i in range(4)}
    specs.update({f"draft.layers.{i}.self_attn": mla(True) for i in range(2)})
    groups = group_layers_into_kv_cache_groups(specs)
    assert len(groups) == 2
    assert groups[0].layer_names == [f"model.layers.{i}.self_attn" for i in range(4)]
    assert groups[0].kv_cache_spec.non_causal_multi_token_decode is False
    assert groups[1].layer_names == ["draft.layers.0.self_attn", "draft.layers.1.self_attn"]
    assert groups[1].kv_cache_spec.non_causal_multi_token_decode is True


def test_uniform_layers_form_one_group_and_order_is_kept():
    specs = {"b": mla(), "a": mla(), "c": mla()}
    groups = group_layers_into_kv_cache_groups(specs)
    assert [g.layer_names for g in groups] == [["b", "a", "c"]]
    # Interleaved causal/non-causal layers: groups by first appearance, order kept inside.
    specs = {"x0": mla(True), "y0": mla(False), "x1": mla(True), "y1": mla(False)}
    groups = group_layers_into_kv_cache_groups(specs)
    assert [g.layer_names for g in groups] == [["x0", "x1"], ["y0", "y1"]]


def test_num_blocks_from_budget():
    specs = {"t0": mla(), "t1": mla(), "d0": mla(True)}
    page = 16 * 576 * 2
    assert get_num_blocks(10 * 3 * page + page, specs) == 10
    assert get_num_blocks(10 * 3 * page, list(specs.values())) == 10
    with pytest.raises(ValueError, match="cannot hold a single block"):
        get_num_blocks(3 * page - 1, specs)
    cfg = get_kv_cache_config(specs, memory_bytes=7 * 3 * page)
    assert cfg.num_blocks == 7 and len(cfg.kv_cache_groups) == 2
    assert cfg.layer_names == ["t0", "t1", "d0"]
    assert get_kv_cache_config(specs, num_blocks=5).num_blocks == 5
    with pytest.raises(ValueError, match="exactly one"):
        get_kv_cache_config(specs, memory_bytes=10**6, num_blocks=5)
    assert num_virtual_blocks(33, 16, 2) == 2 and num_virtual_blocks(32, 16, 1) == 2
    assert num_virtual_blocks(0, 16, 4) == 0


def test_block_pool_exhaustion_and_errors():
    pool = BlockPool(4)
    first = pool.allocate(3)
    assert len(set(first)) == 3 and pool.num_free_blocks == 1
    with pytest.raises(NoFreeBlocksError, match="requested 2 .* only 1 of 4"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1  # a failed allocation takes nothing
    pool.incref([first[0]])
    pool.free([first[0]])
    assert pool.num_free_blocks == 1 and pool.ref_count(first[0]) == 1
    pool.free([first[0]])
    assert pool.num_free_blocks == 2
    with pytest.raises(ValueError, match=f"block {first[0]} is freed"):
        pool.free([first[0]])
    with pytest.raises(ValueError, match=f"block {first[1]} is freed 2"):
        pool.free([first[1], first[1]])
    assert pool.ref_count(first[1]) == 1  # the failed free changed nothing
    with pytest.raises(ValueError, match="block id 9"):
        pool.free([9])
    with pytest.raises(ValueError, match="is free"):
        pool.incref([first[0]])
    assert pool.usage == pytest.approx(0.5)


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["alloc", "free", "share"]), st.integers(0, 5)),
                    max_size=40))
def test_block_pool_never_hands_out_a_used_block(ops):
    pool = BlockPool(8)
    owned: list[int] = []  # one entry per reference held
    for op, n in ops:
        if op == "alloc":
            if n > pool.num_free_blocks:
                with pytest.raises(NoFreeBlocksError):
                    pool.allocate(n)
                continue
            got = pool.allocate(n)
            assert not set(got) & set(owned), "handed out a block that is in use"
            owned += got
        elif op == "free" and owned:
            victim = owned.pop(n % len(owned))
            pool.free([victim])
        elif op == "share" and owned:
            block = owned[n % len(owned)]
            pool.incref([block])
            owned.append(block)
        assert pool.num_free_blocks == 8 - len(set(owned))


# ------------------------------------------------- DCP-sharded vs replicated groups
SHARDING = "must agree on dcp_sharded"


def test_dcp_sharded_is_a_keyword_group_property_defaulting_to_sharded():
    assert mla().dcp_sharded is True
    assert MLAAttentionSpec(16, dtype=torch.bfloat16, dcp_sharded=False).dcp_sharded is False
    with pytest.raises(ValueError, match="dcp_sharded=1 is invalid"):
        MLAAttentionSpec(16, dtype=torch.bfloat16, dcp_sharded=1)


@pytest.mark.parametrize("non_causal", [False, True])
def test_sharded_and_replicated_layers_never_merge(non_causal):
    """A causal EAGLE draft layer has the target's geometry exactly; only dcp_sharded differs."""
    target = MLAAttentionSpec(16, dtype=torch.bfloat16, non_causal_multi_token_decode=non_causal)
    draft = MLAAttentionSpec(16, dtype=torch.bfloat16, non_causal_multi_token_decode=non_causal,
                             dcp_sharded=False)
    with pytest.raises(AssertionError, match=SHARDING):
        MLAAttentionSpec.merge([target, draft])
    plain = FullAttentionSpec(16, 8, 128, torch.float16)
    with pytest.raises(AssertionError, match="cannot merge"):
        FullAttentionSpec.merge([plain, FullAttentionSpec(16, 8, 128, torch.float16,
                                                          dcp_sharded=False)])
    specs = {"model.layers.0.self_attn": target, "draft_model.layers.0.self_attn": draft,
             "model.layers.1.self_attn": target}
    groups = group_layers_into_kv_cache_groups(specs)
    assert [g.layer_names for g in groups] == [
        ["model.layers.0.self_attn", "model.layers.1.self_attn"],
        ["draft_model.layers.0.self_attn"]]
    assert [g.kv_cache_spec.dcp_sharded for g in groups] == [True, False]
    # Same sharding merges as before.
    assert len(group_layers_into_kv_cache_groups({"a": draft, "b": draft})) == 1


@pytest.mark.parametrize("dcp", [1, 2, 4])
def test_replicated_group_costs_dcp_pages_per_block_id(dcp):
    """One block id covers block_size * dcp global tokens: a sharded rank stores block_size of
    them (1 page), a replicated rank all of them (dcp pages)."""
    page = mla().page_size_bytes
    specs = {"t0": mla(), "t1": mla(),
             "d0": MLAAttentionSpec(16, dtype=torch.bfloat16, dcp_sharded=False)}
    per_block = 2 * page + dcp * page
    assert get_num_blocks(7 * per_block + page, specs, dcp) == 7
    cfg = get_kv_cache_config(specs, memory_bytes=7 * per_block, dcp_size=dcp)
    assert (cfg.num_blocks, cfg.dcp_size) == (7, dcp)
    by_name = {tuple(g.layer_names): i for i, g in enumerate(cfg.kv_cache_groups)}
    assert cfg.group_num_blocks(by_name[("t0", "t1")]) == 7
    assert cfg.group_num_blocks(by_name[("d0",)]) == 7 * dcp
    # Token capacity per rank: the replicated group holds every token of the 7 virtual blocks.
    assert cfg.group_num_blocks(by_name[("d0",)]) * 16 == 7 * 16 * dcp
    with pytest.raises(ValueError, match="dcp_size=0 is invalid"):
        get_kv_cache_config(specs, num_blocks=3, dcp_size=0)
