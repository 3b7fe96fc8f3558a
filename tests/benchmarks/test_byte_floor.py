"""vllm/benchmarks/byte_floor.py: the bytes of a plain and a block-drafter decode step, against a
count made by hand from the config dimensions (not from the modules' parameters)."""
import json

import pytest

from vllm.benchmarks.byte_floor import build_models, step_bytes
from vllm.model_executor.models.tiny import tiny_dspark_config, tiny_target_config


def _layer_params(c: dict) -> int:
    """One dense MLA decoder layer of config `c`, by hand (DeepSeek-V3 shapes)."""
    d, h = c["hidden_size"], c["num_attention_heads"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    r, kv = c["q_lora_rank"], c["kv_lora_rank"]
    attention = (r * d + r + h * (nope + rope) * r + (kv + rope) * d + kv
                 + h * (nope + v) * kv + d * h * v)
    return attention + 3 * d * c["intermediate_size"] + 2 * d  # MLP + two norms


@pytest.fixture
def dense_pair(tmp_path):
    target = tiny_target_config(first_k_dense_replace=3, n_routed_experts=None)
    drafter = tiny_dspark_config(target, num_layers=2, markov_rank=8)
    for name, config in (("target", target), ("draft", drafter)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    return target, drafter, str(tmp_path / "target"), str(tmp_path / "draft")


@pytest.mark.parametrize("batch,context", [(1, 0), (1, 100), (8, 257)])
def test_step_bytes_equal_a_count_by_hand(dense_pair, batch, context):
    t, dr, target_dir, draft_dir = dense_pair
    target, drafter = build_models(target_dir, draft_dir, dtype="float32")
    got = step_bytes(target, drafter, batch, context)
    width, d, vocab = 4, t["hidden_size"], t["vocab_size"]
    kv_row = (t["kv_lora_rank"] + t["qk_rope_head_dim"]) * width
    lm_head = vocab * d
    plain = (t["num_hidden_layers"] * _layer_params(t) + d + lm_head) * width
    assert got.plain_weights == plain  # (+ d: the final norm; the embedding is not read)
    assert got.plain_kv == batch * context * kv_row * t["num_hidden_layers"]
    layers = dr["num_hidden_layers"]
    fc = len(dr["target_layer_ids"]) * t["hidden_size"] * d
    markov = 2 * vocab * dr["markov_rank"]  # low-rank head: [V, r] and [r, V]
    kv_a = (t["kv_lora_rank"] + t["qk_rope_head_dim"]) * d
    draft = (fc + d + layers * _layer_params(dr) + d + markov + lm_head + layers * kv_a) * width
    assert got.draft_weights == draft, got.breakdown
    assert got.draft_kv == batch * context * kv_row * layers
    assert got.overhead_floor == pytest.approx((plain + draft + got.plain_kv + got.draft_kv)
                                               / (plain + got.plain_kv))


def test_without_a_drafter_there_is_no_overhead(dense_pair):
    _, _, target_dir, draft_dir = dense_pair
    target, _ = build_models(target_dir, draft_dir, dtype="float32")
    assert step_bytes(target, None, 4, 64).overhead_floor == 1.0


def test_bad_sizes_are_refused(dense_pair):
    _, _, target_dir, draft_dir = dense_pair
    target, drafter = build_models(target_dir, draft_dir, dtype="float32")
    with pytest.raises(ValueError, match="batch >= 1"):
        step_bytes(target, drafter, 0, 64)
