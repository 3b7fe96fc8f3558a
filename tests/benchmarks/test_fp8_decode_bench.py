"""benchmarks/benchmark_fp8_decode.py's driver on CPU, with benchmark_decode's engine run faked:
bf16 and fp8 engines alternate in rounds and the ratios pair runs of the same round."""
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_engines_alternate_and_ratios_pair_within_rounds(monkeypatch, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("benchmark_fp8_decode",
                                                  ROOT / "benchmarks" / "benchmark_fp8_decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    calls = []

    def run_case(args, method, batch, context, eager, async_scheduling):
        assert (method, eager, async_scheduling) == ("none", False, True)
        assert args.load_format == "dummy" and args.num_spec_tokens == 0
        calls.append((args.quantization, batch))
        drift = 1.1 ** len(calls)  # the machine slows down run after run
        fp8 = args.quantization == "fp8"
        return {"kernel_ms": (0.9 if fp8 else 1.0) * drift,
                "step_ms_median_single": (0.95 if fp8 else 1.0) * drift,
                "step_ms": 1.2 * drift, "weight_GB": 1.17 if fp8 else 1.84}

    fake = SimpleNamespace(run_case=run_case, copy_bandwidth=lambda: 4.0e12)
    monkeypatch.setattr(module, "_decode_benchmark", lambda: fake)
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    out = tmp_path / "fp8.json"
    monkeypatch.setattr(sys, "argv", ["benchmark_fp8_decode.py", "--batch-sizes", "1", "32",
                                      "--rounds", "2", "--json", str(out)])
    module.main()
    # one dropped warm-up round, then two kept rounds in alternating order, per batch size
    assert calls == [(None, 1), ("fp8", 1), ("fp8", 1), (None, 1), (None, 1), ("fp8", 1),
                     (None, 32), ("fp8", 32), ("fp8", 32), (None, 32), (None, 32), ("fp8", 32)]
    rows = json.loads(out.read_text())
    assert [r["batch"] for r in rows] == [1, 32]
    for r in rows:
        assert r["kernel_ms"]["fp8_over_bf16"] == pytest.approx(0.9)
        assert r["step_ms_median_single"]["fp8_over_bf16"] == pytest.approx(0.95)
        assert r["step_ms"]["fp8_over_bf16"] == pytest.approx(1.0)
        assert len(r["kernel_ms"]["rounds"]) == 2
    assert "geometric mean of 2 paired rounds" in capsys.readouterr().out
