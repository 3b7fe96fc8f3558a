"""Alternating rounds and paired ratios (vllm/benchmarks/rounds.py) on a machine that drifts."""
import pytest

from vllm.benchmarks.rounds import alternating_rounds, paired_ratio, round_spread


def test_alternating_rounds_and_paired_ratios_cancel_a_steady_drift():
    calls = []

    # Each run is 10 % slower than the one before. The best run of each case compares different
    # moments (0.864 here); rounds in alternating order over an even count see the true 0.96.
    def run(speed):
        calls.append(speed)
        return speed * 0.9 ** len(calls)

    results = alternating_rounds({"base": 1.0, "new": 0.96}, 4, run)
    assert calls == [1.0, 0.96, 0.96, 1.0] * 2
    ratio, ratios = paired_ratio(results["new"], results["base"])
    assert len(ratios) == 4 and ratio == pytest.approx(0.96)
    assert max(results["new"]) / max(results["base"]) == pytest.approx(0.96 * 0.9)


def test_warmup_rounds_are_dropped_and_bad_counts_refused():
    calls = []
    results = alternating_rounds({"a": 1, "b": 2}, 2, lambda c: calls.append(c) or len(calls),
                                 warmup_rounds=1)
    assert calls == [1, 2, 2, 1, 1, 2]
    assert results == {"a": [4, 5], "b": [3, 6]}
    with pytest.raises(ValueError, match="rounds=0 is invalid"):
        alternating_rounds({"a": 1}, 0, lambda c: c)
    with pytest.raises(ValueError, match="warmup_rounds=-1 is invalid"):
        alternating_rounds({"a": 1}, 1, lambda c: c, warmup_rounds=-1)
    with pytest.raises(ValueError, match="as many runs as base runs"):
        paired_ratio([1.0], [1.0, 2.0])


def test_setting_rows_take_medians_and_median_ratios_per_batch_and_setting():
    """rounds.setting_rows (the scripts' A/B tables): per (batch, setting) the median tok/s
    of each variant and the median of the per-round ratios to the first variant."""
    from vllm.benchmarks.rounds import setting_rows, setting_table
    tok_s = {("0", 1, "none"): [100.0, 300.0, 200.0], ("0", 1, "always"): [150.0, 300.0, 500.0],
             ("1", 1, "none"): [100.0, 100.0, 100.0], ("1", 1, "always"): [90.0, 110.0, 130.0]}
    rows = setting_rows(tok_s, ["0", "1"], [1], ["none", "always"])
    # round ratios 1.5, 1.0, 2.5 -> median 1.5 (not the ratio of the medians, 300 / 200)
    assert rows == [{"batch": 1, "setting": "0", "none": 200.0, "always": 300.0,
                     "always/none": 1.5},
                    {"batch": 1, "setting": "1", "none": 100.0, "always": 110.0,
                     "always/none": 1.1}]
    table = setting_table(rows, "S", ["none", "always"], label=lambda s: f"<{s}>")
    assert table.splitlines()[2] == "| 1 | <0> | 200 | 300 | 1.500 |"


def test_one_stalled_baseline_round_lifts_the_mean_not_the_median():
    # the thirty-fourth session's TB rounds: four near 1.5 and one where the baseline stalled
    ratios = [1.499, 1.530, 2.323, 1.477, 1.525]
    mean, _ = paired_ratio(ratios, [1.0] * 5)
    med, lo, hi = round_spread(ratios)
    assert mean == pytest.approx(1.644, abs=1e-3)
    assert (med, lo, hi) == (1.525, 1.477, 2.323)
    with pytest.raises(ValueError, match="at least one round"):
        round_spread([])
