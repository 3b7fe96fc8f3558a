"""benchmarks/engine/benchmark_prefill.py: the FLOP counts against brute force (visible pairs of
the causal mask enumerated chunk by chunk; linear FLOPs from the parameters of the instantiated
model), and a CPU smoke run of the script on the tiny model checking its JSON."""
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from vllm.benchmarks.prefill_flops import (
    attention_flops,
    chunk_schedule,
    linear_weights_per_token,
    matmul_flops,
)
from vllm.model_executor.models.deepseek_v3 import DeepseekV3ForCausalLM
from vllm.model_executor.models.tiny import tiny_target_config
from vllm.transformers_utils.config import HFConfig, load_hf_config

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "benchmarks" / "engine" / "benchmark_prefill.py"
V3_RANK = ROOT / "benchmarks" / "configs" / "deepseek_v3_tp8_rank"


def _load_script():
    spec = importlib.util.spec_from_file_location("benchmark_prefill", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def brute_attention_flops(cfg: dict, num_tokens: int, budget: int) -> int:
    """Enumerate, chunk by chunk, which keys each new token sees (its chunk causally, every
    earlier token fully) and charge 2 * (d_qk + d_v) FLOPs per visible pair, head and layer."""
    pairs, start = 0, 0
    while start < num_tokens:
        end = min(start + budget, num_tokens)
        keys = torch.arange(end)[None, :]
        queries = torch.arange(start, end)[:, None]
        pairs += int((keys <= queries).sum())
        start = end
    d = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"]
    return cfg["num_hidden_layers"] * cfg["num_attention_heads"] * 2 * pairs * d


def brute_linear_weights(model, cfg: dict) -> float:
    """Weights one token multiplies, read off the instantiated model's parameters: every matrix
    of the decoder layers, routed experts at top-k / n_routed (embedding, norms, biases and the
    LM head excluded)."""
    total = 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or not name.startswith("model.layers."):
            continue
        share = 1.0
        if ".mlp.experts." in name:
            share = cfg["num_experts_per_tok"] / cfg["n_routed_experts"]
        total += p.numel() * share
    return total


@pytest.mark.parametrize("num_tokens,budget", [(1, 1), (37, 1), (37, 7), (37, 16), (37, 64),
                                               (256, 64)])
def test_attention_flops_equal_the_enumerated_mask(num_tokens, budget):
    cfg = tiny_target_config()
    got = sum(attention_flops(cfg, m, ctx) for ctx, m in chunk_schedule(num_tokens, budget))
    assert got == brute_attention_flops(cfg, num_tokens, budget)
    # Chunking does not change the work: equal to the whole prompt's causal count.
    assert got == attention_flops(cfg, num_tokens) == brute_attention_flops(cfg, num_tokens,
                                                                            num_tokens)


def test_chunk_schedule_tiles_the_prompt():
    assert chunk_schedule(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert chunk_schedule(3, 8) == [(0, 3)]


@pytest.mark.parametrize("which", ["tiny_moe", "v3_rank_dense"])
def test_matmul_flops_equal_the_model_parameters(which):
    if which == "tiny_moe":
        cfg = tiny_target_config()
        hf = HFConfig(cfg)
    else:
        hf = load_hf_config(str(V3_RANK))
        cfg = json.loads((V3_RANK / "config.json").read_text())
    # Parameters are torch.empty and never written, so even the V3-rank config costs little
    # resident memory (not the meta device: the rotary tables are computed at construction).
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = DeepseekV3ForCausalLM(hf_config=hf)
    finally:
        torch.set_default_dtype(prev)
    assert linear_weights_per_token(hf) == pytest.approx(brute_linear_weights(model, cfg), rel=1e-12)
    lm_head = model.lm_head.weight.numel()
    assert matmul_flops(hf, 100) == pytest.approx(
        2 * 100 * brute_linear_weights(model, cfg) + 2 * lm_head, rel=1e-12)


def test_cpu_smoke_run_writes_the_documented_json(tmp_path, capsys):
    bench = _load_script()
    out = tmp_path / "prefill"
    bench.main(["--model", "tiny", "--device", "cpu", "--contexts", "256", "--chunk", "64",
                "--repeats", "1", "--warmup", "0", "--decode-steps", "2", "--decode-warmup", "1",
                "--attention-contexts", "256", "--attn-repeats", "1", "--out", str(out)])
    result = json.loads((out / "prefill.json").read_text())
    cfg = tiny_target_config()
    assert result["peak_tflops"] == 989.0
    assert "L(L+1)/2" in result["formulas"]["attention"]
    (row,) = result["prefill"]
    assert (row["context"], row["budget"], row["num_steps"]) == (256, 64, 4)
    assert row["attention_flops"] == brute_attention_flops(cfg, 256, 64)
    assert row["ttft_ms"] > 0
    assert row["prefill_tok_s"] == pytest.approx(256 / (row["ttft_ms"] / 1e3))
    assert row["total_flops"] == pytest.approx(row["attention_flops"] + row["matmul_flops"])
    assert row["mfu"] == pytest.approx(row["total_flops"] / (row["ttft_ms"] / 1e3) / 989e12)
    assert row["weights_GB"] > 0 and row["kv_cache_GB"] > 0 and row["planned_workspace_GB"] > 0
    assert row["peak_GB"] is None and row["init_GB"] is None  # no CUDA: no GPU memory to report
    # No engine memory plan on the CPU either (the worker profiles GPU memory only).
    assert row["planned_GB"] is None and row["peak_over_engine_plan"] is None
    assert [d["method"] for d in result["decode"]] == ["none", "dspark"]
    assert all(d["step_ms"] > 0 and d["tokens_per_step"] >= 1 for d in result["decode"])
    (attn,) = result["attention"]
    heads, d_qk, d_v = cfg["num_attention_heads"], 96, 32
    assert attn["attention_flops"] == brute_attention_flops(
        {**cfg, "num_hidden_layers": 1}, 256, 64) == heads * 2 * (256 * 257 // 2) * (d_qk + d_v)
    assert attn["num_steps"] == 4 and attn["path_tflops"] > 0 and attn["kernel_tflops"] > 0
    table = capsys.readouterr().out.strip().splitlines()
    assert table[-2].split()[:3] == ["L", "chunk", "ttft_ms"]  # the prefill table prints last
    assert table[-1].split()[:2] == ["256", "64"]


@pytest.mark.parametrize("argv,needle", [
    (["--contexts", "lots"], "'lots' is not an integer"),
    (["--decode-methods", "eagle"], "unknown; use none and/or dspark"),
    (["--repeats", "0"], "--repeats=0 must be >= 1"),
    (["--model", "/nonexistent"], "no config.json"),
])
def test_bad_arguments_name_the_value(argv, needle, capsys):
    bench = _load_script()
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", *argv])
    assert needle in capsys.readouterr().err


def test_help_states_the_flop_formula(capsys):
    bench = _load_script()
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    text = capsys.readouterr().out
    assert "L(L+1)/2" in text and "--max-num-batched-tokens" in text and "989" in text
    assert math.isclose(bench.parse_tokens("32k"), 32768)
