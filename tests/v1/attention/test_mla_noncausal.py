"""The non-causal multi-token-decode marker of MLA layers (DESIGN §1.3).

Upstream names these cases after "promotion" of the layer marker to a group capability. In this
project the marker is never promoted by any(): a KV cache group carries it only when EVERY layer in
it does (MLAAttentionSpec.merge demands agreement), so causal target layers and non-causal draft
layers always land in different groups and builders. The tests assert exactly that.
"""
import pytest
import torch

from tests.utils.mla_dcp_helpers import parallel_config
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.mla.torch_mla import TorchMLAMetadataBuilder
from vllm.v1.core.kv_cache_utils import group_layers_into_kv_cache_groups
from vllm.v1.kv_cache_interface import MLAAttentionSpec

AGREEMENT = "must agree on non_causal_multi_token_decode"


def _spec(non_causal: bool) -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=16, dtype=torch.float32,
                            non_causal_multi_token_decode=non_causal)


def _block_batch(causal: bool) -> CommonAttentionMetadata:
    """Two requests, a Q=4 block each, 20 and 30 tokens long."""
    qsl = torch.tensor([0, 4, 8], dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl.clone(), query_start_loc_cpu=qsl,
        seq_lens=torch.tensor([20, 30], dtype=torch.int32), num_reqs=2, num_actual_tokens=8,
        max_query_len=4, max_seq_len=30,
        block_table_tensor=torch.arange(8, dtype=torch.int32).view(2, 4),
        slot_mapping=torch.zeros(8, dtype=torch.int64), causal=causal)


def _groups():
    specs = {f"model.layers.{i}.self_attn": _spec(False) for i in range(4)}
    specs.update({f"draft_model.model.layers.{i}.self_attn": _spec(True) for i in range(2)})
    return group_layers_into_kv_cache_groups(specs)


def _builder(group) -> TorchMLAMetadataBuilder:
    return TorchMLAMetadataBuilder(group.kv_cache_spec, group.layer_names, parallel_config(1, 1),
                                   "cpu", dcp_rank=0)


def test_mla_cache_marker_is_promoted_to_group_capability():
    """A group whose layers ALL carry the marker gets it as its capability (its builder accepts
    non-causal blocks); a group of causal layers does not (its builder refuses them); a mixed
    group cannot exist, since merge refuses to build it (no any() promotion)."""
    target, draft = _groups()
    assert draft.kv_cache_spec.non_causal_multi_token_decode is True
    assert target.kv_cache_spec.non_causal_multi_token_decode is False
    md = _builder(draft).build(0, _block_batch(causal=False))
    assert md.causal is False and md.decode.row_seq_lens.tolist() == [20] * 4 + [30] * 4
    with pytest.raises(ValueError, match="explicitly supported"):
        _builder(target).build(0, _block_batch(causal=False))
    with pytest.raises(AssertionError, match=AGREEMENT):
        MLAAttentionSpec.merge([_spec(False), _spec(True)])
    with pytest.raises(AssertionError, match=AGREEMENT):
        MLAAttentionSpec.merge([_spec(True), _spec(True), _spec(False)])


def test_mla_cache_marker_is_a_group_property():
    """The marker belongs to the KV cache group, not to a step: the marked draft group still
    builds causal batches (causality is chosen per step), the target group never inherits the
    draft layers' marker, and each group's layers share one builder and one spec."""
    target, draft = _groups()
    assert target.layer_names == [f"model.layers.{i}.self_attn" for i in range(4)]
    assert draft.layer_names == [f"draft_model.model.layers.{i}.self_attn" for i in range(2)]
    draft_builder = _builder(draft)
    draft_builder.reorder_batch_threshold = 4  # Q=4 verification rows are decode rows
    causal_md = draft_builder.build(0, _block_batch(causal=True))
    assert causal_md.causal is True
    # Row j of a causal Q=4 block sees G - (Q-1-j) tokens.
    assert causal_md.decode.row_seq_lens.tolist() == [17, 18, 19, 20, 27, 28, 29, 30]
    merged = MLAAttentionSpec.merge([_spec(True)] * 3)
    assert merged.non_causal_multi_token_decode is True
    assert MLAAttentionSpec.merge([_spec(False)] * 3).non_causal_multi_token_decode is False
