"""Side-by-side benchmark runs that a drifting machine cannot bias.

A GPU node's timings move by ~10 % between processes and over minutes (clocks, caches, other
tenants, the first engine of a process paying one-time costs). Comparing the best run of A with
the best run of B then compares different moments. Instead every case runs once per round, the
order reversed in every other round, warm-up rounds are dropped, and a ratio is the geometric
mean of the per-round ratios: over an even number of rounds a steady drift cancels.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any


def alternating_rounds(cases: dict[str, Any], rounds: int, run: Callable[[Any], Any],
                       warmup_rounds: int = 0) -> dict[str, list]:
    """{name: [run(case) of each kept round]}; the order of `cases` flips every other round."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds} is invalid: it must be >= 1")
    if warmup_rounds < 0:
        raise ValueError(f"warmup_rounds={warmup_rounds} is invalid: it must be >= 0")
    names = list(cases)
    results: dict[str, list] = {name: [] for name in names}
    for i in range(warmup_rounds + rounds):
        for name in (names if i % 2 == 0 else names[::-1]):
            result = run(cases[name])
            if i >= warmup_rounds:
                results[name].append(result)
    return results


def paired_ratio(values: list[float], base: list[float]) -> tuple[float, list[float]]:
    """Geometric mean over rounds of values[i] / base[i], and the per-round ratios."""
    if len(values) != len(base) or not values:
        raise ValueError(f"paired_ratio needs as many runs as base runs (got {len(values)} and "
                         f"{len(base)}); run both in the same rounds")
    ratios = [v / b for v, b in zip(values, base)]
    return math.exp(sum(math.log(x) for x in ratios) / len(ratios)), ratios


def round_spread(ratios: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of per-round ratios. Printed beside paired_ratio's geometric mean:
    one round in which the baseline stalled (a noisy host) lifts the mean, not the median
    (thirty-fourth session: rounds of 1.48-1.53 and one of 2.32 gave a mean of 1.64)."""
    if not ratios:
        raise ValueError("round_spread needs at least one round")
    return statistics.median(ratios), min(ratios), max(ratios)


def setting_rows(tok_s: dict[tuple, list[float]], settings: list, batch_sizes: list[int],
                 variants: list[str]) -> list[dict]:
    """An in-process A/B of engine settings (scripts/ab_*.py): `tok_s[(setting, batch,
    variant)]` lists every kept round's tok/s in round order. Per batch size and setting a
    row {"batch", "setting", <variant>: median tok/s, "<variant>/<first>": the median of the
    per-round ratios to the first variant (the baseline)}."""
    rows, base = [], variants[0]
    for batch in batch_sizes:
        for setting in settings:
            row = {"batch": batch, "setting": setting}
            for variant in variants:
                runs = tok_s[(setting, batch, variant)]
                row[variant] = statistics.median(runs)
                if variant != base:
                    row[f"{variant}/{base}"] = statistics.median(
                        a / b for a, b in zip(runs, tok_s[(setting, batch, base)]))
            rows.append(row)
    return rows


def setting_table(rows: list[dict], setting_name: str, variants: list[str],
                  label: Callable[[Any], str] = str) -> str:
    """setting_rows as a markdown table (tok/s, then each variant's ratio to the first)."""
    base, others = variants[0], variants[1:]
    lines = [f"| B | {setting_name} | " + " | ".join(f"{v} tok/s" for v in variants) + " | "
             + " | ".join(f"{v} / {base}" for v in others) + " |",
             "|---" * (2 + len(variants) + len(others)) + "|"]
    for row in rows:
        lines.append(f"| {row['batch']} | {label(row['setting'])} | "
                     + " | ".join(f"{row[v]:.0f}" for v in variants) + " | "
                     + " | ".join(f"{row[f'{v}/{base}']:.3f}" for v in others) + " |")
    return "\n".join(lines)
