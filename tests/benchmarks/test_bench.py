"""`vllm bench latency|throughput` on the built-in tiny model with DSpark (the default), plus
unit checks of the summary maths against hand-computed values."""
import json

import pytest

from vllm.benchmarks.offline import spec_decode_delta
from vllm.benchmarks.results import describe_ms, summarize_requests
from vllm.entrypoints.cli.main import main
from vllm.v1.metrics.stats import RequestTimer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_request_timer_hand_computed():
    timer = RequestTimer(arrival_time=10.0)
    timer.record_tokens(1, now=10.5)   # TTFT 0.5
    timer.record_tokens(3, now=11.1)   # a speculative burst of 3 tokens after 0.6 s
    timer.record_tokens(0, now=12.0)   # nothing new: ignored
    timer.record_tokens(1, now=11.3)
    assert timer.ttft == pytest.approx(0.5)
    assert timer.num_generation_tokens == 5
    assert timer.tpot == pytest.approx((11.3 - 10.5) / 4)
    assert timer.e2e_latency == pytest.approx(1.3)
    assert timer.inter_token_latencies() == pytest.approx([0.2, 0.2, 0.2, 0.2])


def test_summary_and_spec_delta_hand_computed():
    a, b = RequestTimer(arrival_time=0.0), RequestTimer(arrival_time=0.0)
    a.record_tokens(1, now=0.1); a.record_tokens(1, now=0.3)
    b.record_tokens(2, now=0.2)
    s = summarize_requests([a, b], duration_s=2.0, num_prompt_tokens=10)
    assert s["total_output_tokens"] == 4
    assert s["output_throughput_tok_per_s"] == pytest.approx(2.0)
    assert s["total_token_throughput_tok_per_s"] == pytest.approx(7.0)
    assert s["ttft"]["mean_ms"] == pytest.approx(150.0)
    assert s["tpot"]["mean_ms"] == pytest.approx((200.0 + 0.0) / 2)
    assert describe_ms([])["count"] == 0
    before = {"num_drafts": 2, "num_draft_tokens": 8, "num_accepted_tokens": 3,
              "accepted_per_position": [2, 1, 0, 0]}
    after = {"num_drafts": 6, "num_draft_tokens": 24, "num_accepted_tokens": 9,
             "accepted_per_position": [5, 3, 1, 0]}
    d = spec_decode_delta(before, after)
    assert d["num_drafts"] == 4 and d["num_accepted_tokens"] == 6
    assert d["mean_acceptance_length"] == pytest.approx(1 + 6 / 4)
    assert d["acceptance_rate_per_position"] == pytest.approx([0.75, 0.5, 0.25, 0.0])
    assert d["draft_acceptance_rate"] == pytest.approx(6 / 16)
    assert spec_decode_delta(None, None) is None


def _run(argv, capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(argv)
    assert excinfo.value.code == 0
    return capsys.readouterr().out


def _check_sane(result, num_requests, output_len):
    assert result["num_requests"] == num_requests
    assert result["total_output_tokens"] == num_requests * output_len  # ignore_eos: exact length
    assert result["output_throughput_tok_per_s"] > 0
    assert 0 < result["ttft"]["mean_ms"] < 60_000
    assert 0 < result["tpot"]["mean_ms"] < 60_000
    assert result["itl"]["count"] == num_requests * (output_len - 1)
    spec = result["spec_decode"]
    assert spec is not None and spec["num_drafts"] > 0
    assert spec["mean_acceptance_length"] >= 1.0
    # greedy verification accepts position i only if every earlier position was accepted
    per_pos = spec["accepted_per_position"]
    assert all(x >= y for x, y in zip(per_pos, per_pos[1:]))
    assert sum(per_pos) == spec["num_accepted_tokens"]


@pytest.mark.slow
def test_bench_latency_tiny_dspark(tmp_path, capsys):
    out_json, out_png = tmp_path / "latency.json", tmp_path / "latency.png"
    out = _run(["bench", "latency", "--input-len", "8", "--output-len", "8", "--batch-size", "2",
                "--num-iters-warmup", "1", "--num-iters", "2", "--max-model-len", "128",
                "--device", "cpu", "--no-progress", "--output-json", str(out_json),
                "--output-png", str(out_png)], capsys)
    for label in ("TTFT", "TPOT", "ITL", "mean acceptance length", "batch latency"):
        assert label in out
    # Upstream's lines (vllm/benchmarks/latency.py): "Avg latency: X seconds" and percentiles.
    lines = out.splitlines()
    assert any(line.startswith("Avg latency: ") and line.endswith(" seconds") for line in lines)
    for p in (10, 25, 50, 75, 90, 99):
        assert any(line.startswith(f"{p}% percentile latency: ") for line in lines), p
    result = json.loads(out_json.read_text())
    _check_sane(result, num_requests=4, output_len=8)
    assert result["latency"]["count"] == 2 and result["latency"]["mean_ms"] > 0
    # Upstream's JSON keys: avg_latency, latencies, percentiles{"10".."99"} (seconds).
    assert len(result["latencies"]) == 2
    assert result["avg_latency"] == pytest.approx(sum(result["latencies"]) / 2)
    assert set(result["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert result["avg_latency"] * 1000 == pytest.approx(result["latency"]["mean_ms"])
    assert out_png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_bench_throughput_tiny_dspark(tmp_path, capsys):
    out_json = tmp_path / "throughput.json"
    out = _run(["bench", "throughput", "--backend", "vllm", "--dataset-name", "random",
                "--num-prompts", "6", "--random-input-len", "8", "--output-len",
                "8", "--max-model-len", "128", "--device", "cpu", "--disable-tqdm",
                "--output-json", str(out_json)], capsys)
    assert "output tok/s" in out
    result = json.loads(out_json.read_text())
    _check_sane(result, num_requests=6, output_len=8)
    # Upstream's line and JSON keys (vllm/benchmarks/throughput.py).
    assert any(line.startswith("Throughput: ") and "requests/s" in line and
               "total tokens/s" in line and "output tokens/s" in line for line in out.splitlines())
    assert "Total num prompt tokens:  48" in out and "Total num output tokens:  48" in out
    for key in ("elapsed_time", "num_requests", "total_num_tokens", "requests_per_second",
                "tokens_per_second"):
        assert key in result, key
    assert result["num_requests"] == 6 and result["total_num_tokens"] == 6 * (8 + 8)
    assert result["tokens_per_second"] == pytest.approx(96 / result["elapsed_time"])
