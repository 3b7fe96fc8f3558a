"""FP8 block quantisation (DeepSeek-V3 format) on CPU: block numerics, the tiny-model fp8 writer,
loading (fp8 layers, dequantised experts / kv_b_proj, online quantisation), logits equal to the
dequantised float checkpoint, TP sharding of block scales, and one-line refusals."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from vllm.forward_context import dense_attention_context
from vllm.config import ModelConfig, VllmConfig
from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod
from vllm.model_executor.layers.quantization.fp8_utils import (FP8_DTYPE, block_dequantize, block_quantize,
                                                               per_token_group_quant_reference)
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.model_loader.fp8_writer import write_fp8_checkpoint
from vllm.model_executor.models.tiny import write_checkpoint, write_random_target

PROMPT = [(7 * i * i + 3 * i + 11) % 256 for i in range(19)]
# the tiny dims (hidden 256, q_lora 96, kv_a 576, ...) leave partial 128-blocks: exercised here
TWO_LAYERS = dict(num_hidden_layers=2)


def _config(model_dir, **model_kwargs) -> VllmConfig:
    return VllmConfig(model_config=ModelConfig(model=model_dir, dtype="float32", device="cpu",
                                               attention_backend="TORCH_MLA", **model_kwargs))


def _logits(model_dir, **model_kwargs):
    model = get_model(_config(model_dir, **model_kwargs))
    with torch.no_grad(), dense_attention_context():
        return model, model.compute_logits(model(torch.tensor(PROMPT), torch.arange(len(PROMPT))))


def test_block_quantize_bounds_and_partial_blocks():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=gen) * torch.linspace(0.01, 3.0, 300)
    q, s = block_quantize(w, (128, 128))
    assert q.dtype == FP8_DTYPE and q.shape == (200, 300) and s.shape == (2, 3)
    # each block's scale is its amax / 448 (brute force over the blocks)
    for i in range(2):
        for j in range(3):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            assert s[i, j].item() == pytest.approx(blk.abs().max().item() / 448.0, rel=1e-6)
    deq = block_dequantize(q, s, (128, 128))
    full_scale = s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normals, plus the subnormal step
    assert ((deq - w).abs() <= w.abs() * 2 ** -4 + full_scale * 2 ** -9).all()
    with pytest.raises(ValueError, match=r"weight_scale_inv shape \(2, 2\)"):
        block_dequantize(q, s[:, :2], (128, 128))


def test_activation_group_quant_reference():
    x = torch.randn(3, 260)
    q, s = per_token_group_quant_reference(x, 128)
    assert s.shape == (3, 3)
    assert s[1, 2].item() == pytest.approx(x[1, 256:].abs().max().item() / 448.0, rel=1e-6)
    torch.testing.assert_close(q.float() * s.repeat_interleave(128, 1)[:, :260], x, rtol=2 ** -4, atol=1e-6)


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    src = write_random_target(str(root / "fp32"), seed=4, **TWO_LAYERS)
    fp8 = write_fp8_checkpoint(src, str(root / "fp8"))
    # oracle: the fp8 checkpoint dequantised by hand into a plain float32 checkpoint
    tensors = load_file(os.path.join(fp8, "model.safetensors"))
    deq = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == FP8_DTYPE:
            s = tensors[name + "_scale_inv"]
            scale = s.repeat_interleave(128, 0)[:t.shape[0]].repeat_interleave(128, 1)[:, :t.shape[1]]
            deq[name] = t.float() * scale
        else:
            deq[name] = t
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    ref = write_checkpoint(str(root / "dequantised"), config, deq)
    return src, fp8, ref


def test_writer_writes_deepseek_format(fp8_pair):
    _, fp8, _ = fp8_pair
    with open(os.path.join(fp8, "config.json"), encoding="utf-8") as f:
        qc = json.load(f)["quantization_config"]
    assert qc == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [128, 128]}
    t = load_file(os.path.join(fp8, "model.safetensors"))
    assert t["model.layers.0.self_attn.o_proj.weight"].dtype == FP8_DTYPE
    assert t["model.layers.0.self_attn.o_proj.weight_scale_inv"].shape == (2, 2)  # 256 x 256
    assert t["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (5, 2)  # 576 x 256
    assert t["model.layers.0.self_attn.q_a_proj.weight_scale_inv"].shape == (1, 2)  # 96 x 256
    assert t["lm_head.weight"].dtype == torch.float32
    assert t["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert os.path.isfile(os.path.join(fp8, "tokenizer.json"))


def test_fp8_checkpoint_logits_equal_dequantised_checkpoint(fp8_pair):
    _, fp8, ref = fp8_pair
    model, ours = _logits(fp8)
    _, expected = _logits(ref)
    rel = (ours - expected).abs().max().item() / expected.abs().max().item()
    assert rel <= 1e-5, rel
    layers = model.model.layers
    attn = layers[0].self_attn
    assert attn.o_proj.weight.dtype == FP8_DTYPE and isinstance(attn.o_proj.quant_method, Fp8LinearMethod)
    assert attn.q_b_proj.weight.dtype == FP8_DTYPE
    assert layers[0].mlp.gate_up_proj.weight.dtype == FP8_DTYPE
    assert layers[1].mlp.shared_experts.down_proj.weight.dtype == FP8_DTYPE
    # dequantised at load (plain torch MoE; MLA absorption reads kv_b_proj's weight)
    experts = layers[1].mlp.experts
    assert experts.w13_weight.dtype == torch.float32 and experts.w2_weight.dtype == torch.float32
    assert attn.kv_b_proj.weight.dtype == torch.float32
    # auto-detected: no --quantization given
    assert model.model.layers[0].self_attn.kv_a_proj_with_mqa.weight_scale_inv.shape == (5, 2)


def test_online_quantization_of_float_checkpoint(tmp_path, fp8_pair):
    """--quantization fp8 on a float checkpoint quantises the fp8-eligible layers at load: logits
    equal a float checkpoint whose eligible weights were replaced by dequant(quant(w)) by hand
    (routed experts and kv_b_proj stay unquantised in this mode)."""
    src, _, _ = fp8_pair
    _, online = _logits(src, quantization="fp8")
    tensors = load_file(os.path.join(src, "model.safetensors"))
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    rounded = {}
    for name, t in tensors.items():
        eligible = (name.endswith("_proj.weight") or name.endswith("_with_mqa.weight")) and \
            ".experts." not in name and "kv_b_proj" not in name
        rounded[name] = block_dequantize(*block_quantize(t, (128, 128)), (128, 128)) if eligible else t
    ref = write_checkpoint(str(tmp_path / "rounded"), config, rounded)
    _, expected = _logits(ref)
    rel = (online - expected).abs().max().item() / expected.abs().max().item()
    assert rel <= 1e-5, rel
    _, plain = _logits(src)
    assert (online - plain).abs().max() > 1e-3  # quantisation really happened


def test_unsupported_and_conflicting_quantization_refused(tmp_path, fp8_pair):
    src, fp8, _ = fp8_pair
    with pytest.raises(ValueError, match="quantization='awq' is invalid"):
        ModelConfig(model=src, quantization="awq")
    bad = tmp_path / "gptq"
    write_random_target(str(bad), seed=1, **TWO_LAYERS,
                        quantization_config={"quant_method": "gptq", "bits": 4})
    with pytest.raises(ValueError, match=r"config.json: quantization method 'gptq' is not supported"):
        get_model(_config(str(bad)))
    nob = tmp_path / "noblock"
    write_random_target(str(nob), seed=1, **TWO_LAYERS, quantization_config={"quant_method": "fp8"})
    with pytest.raises(ValueError, match="without weight_block_size"):
        get_model(_config(str(nob)))


def test_missing_or_misshaped_scale_refused(tmp_path, fp8_pair):
    _, fp8, _ = fp8_pair
    tensors = load_file(os.path.join(fp8, "model.safetensors"))
    with open(os.path.join(fp8, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    expert = "model.layers.1.mlp.experts.0.up_proj.weight"
    no_scale = {k: v for k, v in tensors.items() if k != expert + "_scale_inv"}
    d1 = write_checkpoint(str(tmp_path / "a"), config, no_scale)
    with pytest.raises(ValueError, match=f"'{expert}' is float8_e4m3fn but the checkpoint has no"):
        get_model(_config(d1))
    bad = dict(tensors)
    bad["model.layers.0.self_attn.o_proj.weight_scale_inv"] = torch.ones(1, 2)
    d2 = write_checkpoint(str(tmp_path / "b"), config, bad)
    with pytest.raises(ValueError, match=r"o_proj.weight_scale_inv'.*\(1, 2\) != model shape \(2, 2\)"):
        get_model(_config(d2))


class _FakeGroup:
    def __init__(self, rank, world):
        self.rank_in_group, self.world_size = rank, world


@pytest.mark.parametrize("kind", ["column", "merged", "row"])
def test_tp_shards_block_scales_with_the_weight(monkeypatch, kind):
    """Each TP rank's dequantised shard equals the same slice of the full dequantised weight."""
    import vllm.model_executor.layers.linear as linear
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(512, 384, generator=gen)
    q, s = block_quantize(full, (128, 128))
    expected = block_dequantize(q, s, (128, 128))
    for rank in range(2):
        monkeypatch.setattr(linear, "tp_group", lambda: _FakeGroup(rank, 2))
        if kind == "column":
            layer = linear.ColumnParallelLinear(384, 512)
        elif kind == "merged":
            layer = linear.MergedColumnParallelLinear(384, [256, 256])
        else:
            layer = linear.RowParallelLinear(512, 384)
        if kind == "row":
            q_t, s_t = block_quantize(full.T.contiguous(), (128, 128))  # [384, 512]
            exp = block_dequantize(q_t, s_t, (128, 128))[:, rank * 256:(rank + 1) * 256]
        else:
            q_t, s_t = q, s
            exp = expected[rank * 256:(rank + 1) * 256] if kind == "column" else torch.cat(
                [expected[rank * 128:(rank + 1) * 128], expected[256 + rank * 128:256 + (rank + 1) * 128]])
        Fp8LinearMethod((128, 128)).create_weights(layer, "layer")
        if kind == "merged":
            for shard in range(2):
                layer.weight.weight_loader(layer.weight, q_t[shard * 256:(shard + 1) * 256], shard)
                layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, s_t[shard * 2:(shard + 1) * 2], shard)
        else:
            layer.weight.weight_loader(layer.weight, q_t)
            layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, s_t)
        got = layer.quant_method.dequantized_weight(layer, torch.float32)
        torch.testing.assert_close(got, exp, rtol=0, atol=0)


def test_unaligned_tp_shard_refused(monkeypatch):
    import vllm.model_executor.layers.linear as linear
    monkeypatch.setattr(linear, "tp_group", lambda: _FakeGroup(0, 2))
    layer = linear.ColumnParallelLinear(256, 192)  # 96 rows per rank: not a whole 128-block
    with pytest.raises(ValueError, match=r"per-rank output size\(s\) \[96\] are not multiples of "
                                         r"weight_block_size\[0\]=128"):
        Fp8LinearMethod((128, 128)).create_weights(layer, "model.layers.0.self_attn.q_b_proj")


def test_tiny_model_cli_writes_fp8_target(tmp_path, capsys):
    from vllm.entrypoints.cli.main import main
    with pytest.raises(SystemExit) as info:
        main(["tiny-model", "--output", str(tmp_path / "tiny"), "--train-steps", "0", "--quantize", "fp8"])
    assert info.value.code in (0, None)
    fp8_dir = tmp_path / "tiny" / "target-fp8"
    assert "target-fp8" in capsys.readouterr().out
    with open(fp8_dir / "config.json", encoding="utf-8") as f:
        assert json.load(f)["quantization_config"]["weight_block_size"] == [128, 128]
    model = get_model(_config(str(fp8_dir)))
    assert model.model.layers[0].self_attn.o_proj.weight.dtype == FP8_DTYPE


def test_quantization_flag_reaches_model_config():
    from vllm.engine.arg_utils import EngineArgs
    cfg = EngineArgs(quantization="FP8", device="cpu").create_engine_config()
    assert cfg.model_config.quantization == "fp8"
