"""A block drafter's draft step prepared while the verify step still runs on the GPU.

Why: a synchronous speculative step is a serial chain on the host: prepare and launch the
verify step, wait for its output (the GPU runs; the host idles, 0.35-0.40 ms for the tiny model
on an H200), then write the draft block's inputs and build the draft's attention metadata
(0.4-0.6 ms; the GPU idles), then launch the draft step. The inputs need only device data (the
accepted counts are on the device once the verify step has run: the block input write reads
them in stream order), and the metadata needs host lengths only for the FlashInfer planner,
which can plan for the upper bound (every draft accepted) and have its lengths lowered once the
counts arrive (FlashInferMLAMetadataBuilder.refresh_decode_seq_lens). So the runner launches
the output copy, then the drafter's prepare_early, then waits: the draft's host work overlaps
the verify step, and after the wait only the lowering (or, where a builder cannot, a second
build from the exact lengths) remains.

`VLLM_EARLY_DRAFT_METADATA`: "auto" (default: with a captured greedy draft step and builders
that lower lengths in place, i.e. FlashInfer MLA at DCP 1, and only where it measures faster on
this engine's own steps: EarlyDraftTuner), "0" (never), "1" (wherever the step allows: uniform
decode or verify rows that all sample, DCP 1; eager steps then build twice, which is how the
CPU tests exercise it).

Measured (thirteenth session, one H200, tiny model, DSpark k=4, bf16, graphs, synchronous,
`scripts/probe_early_draft.py`, engines stepped in turn in one process): "auto" against "0"
0.980x tok/s at B=1 and 0.941x at B=8, greedy tokens identical; 134 of 139 early steps
(B=1) and 205 of 267 (B=8) were lowered in place, the rest built again. The tiny model's
verify step is too short for the host work to hide in it, and the lowering and the second
builds cost more than the overlap wins. At DeepSeek-V3 per-TP8-rank dims (random weights,
fourteenth session) it gains ~15 % at B=1 and B=32: the verify step's GPU time there exceeds
the draft's host work. Hence "auto" decides per engine from a measured A/B (EarlyDraftTuner).
Since the twenty-fourth session the early path lowers its plans on the device and advances the
previous step's (device_lowering_enabled, on by default), which made it 1.19-1.30x the late
path's tok/s on the tiny model (B=1, 8) and at V3-rank dims (B=1, 32); the A/B stays, and
benchmarks warm up until it has decided (vllm/benchmarks/warmup.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm.utils.env_flags import switch_flag

ENV_FLAG = "VLLM_EARLY_DRAFT_METADATA"
MODES = ("auto", "1", "0")
# Lower the early plan's lengths on the device, before the wait (below), instead of on the host
# after it, and advance the previous step's plans there. On: with the advance it makes the B=1
# tiny DSpark step 1.9x cheaper on the host (twenty-fourth session, runs KA-KE, one H100).
DEVICE_LOWERING_FLAG = "VLLM_EARLY_DRAFT_DEVICE_LOWERING"
# Fold the held draft plans' lowering into the early step's input write (one launch less a
# step; BlockSpeculator.fuses_plan_lowering, plan_lowering.FusedDraftLowering). Off by default
# until its GPU tests have run (twenty-eighth session: built and CPU-tested, no GPU started).
FUSED_LOWERING_FLAG = "VLLM_FUSED_DRAFT_PLAN_LOWERING"


def device_lowering_enabled() -> bool:
    """Whether prepare_early lowers its upper-bound plans on the device before the runner
    waits (FlashInferMLAMetadataBuilder.lower_decode_seq_lens_on_device): the exact lengths
    are on the device already, and the host knows, before the wait, a lower bound (every draft
    rejected) whose fit proves every outcome fits. What it removes: the host refresh after the
    wait (two refreshes and a copy per step, which made the early path lose on the tiny model,
    thirteenth session). Lowered so, the draft step needs nothing more from the host and is
    launched right there, before the wait, its drafts written to their slots in stream order
    (BlockSpeculator.prepare_early, GPUModelRunner._prepare_draft_early): after the wait the
    proposal is bookkeeping only; and the next such step with the same rows advances those
    plans on the device instead of building its draft metadata
    (BlockSpeculator.prepare_early, advance_decode_plan_on_device).
    Measured: the lowering and launch alone gained ~1 % (twenty-third session: a synchronous
    B=1 DSpark step never waits for the GPU, so what moves in front of the wait is host work
    all the same); with the advance, which removes the draft metadata build in most B=1 steps,
    the B=1 DSpark step's host time fell 1.71 -> 0.90 ms and the lowered engine ran 1.21x
    (B=1) and 1.19x (B=8) the late engine's tok/s, 1.30x / 1.17x at V3-rank dims, greedy
    tokens unchanged (twenty-fourth session, one H100, docs/performance.md). So on by default;
    "0" turns it off (scripts/probe_early_draft.py runs both settings in one process)."""
    return switch_flag(DEVICE_LOWERING_FLAG, True, "lower early draft plans on the device "
                       "before the wait", "on the host after it")


def early_draft_mode() -> str:
    value = os.environ.get(ENV_FLAG, "auto")
    if value not in MODES:
        raise ValueError(f"{ENV_FLAG}={value!r} is invalid: use auto (default: with captured "
                         "draft steps and FlashInfer MLA at DCP 1, where it measures faster), 0 "
                         "(never) or 1 (wherever the step allows, e.g. to test it eagerly)")
    return value


@dataclass
class EarlyDraft:
    """What BlockSpeculator.prepare_early made for this step's draft pass."""

    num_reqs: int
    padded: int
    graph_size: int | None
    attn_metadata: dict[str, Any]   # planned from the upper-bound lengths
    anchors: torch.Tensor
    slot_mappings: torch.Tensor
    target_seq_lens: np.ndarray     # the verify step's lengths (the builders' upper bound)
    # every group's plan was lowered on the device before the wait (nothing left after it)
    lowered_on_device: bool = False
    # the drafts of a draft step launched right after that lowering (prepare_early), or None
    drafts: torch.Tensor | None = None


def _bucket(num_reqs: int) -> int:
    """Batch-size bucket of a decision: the next power of two (1, 2, 4, 8, ...)."""
    return 1 << max(int(num_reqs) - 1, 0).bit_length()


@dataclass
class _Trial:
    samples: dict           # "late" / "early" -> counted step seconds of the trial so far
    phase: str = "late"     # the window being measured, or "decided"
    early: bool = False     # the decision (phase "decided")
    steps_decided: int = 0  # eligible steps since the decision
    stage: int = 1          # 1: the short first windows; 2: their extension to trial_steps
    switching: bool = True  # the window's next step is its first (the switch): not counted


def _clearly_apart(late: list[float], early: list[float], gain: float) -> bool:
    """Whether two windows of step times already say which path is faster: the faster
    window's median is at least `gain` below the slower's, and its upper quartile below the
    slower's lower quartile (the bulk of the two samples does not overlap)."""
    fast, slow = (early, late) if np.median(early) <= np.median(late) else (late, early)
    return bool(np.median(fast) <= np.median(slow) * (1.0 - gain)
                and np.percentile(fast, 75) < np.percentile(slow, 25))


class EarlyDraftTuner:
    """Mode "auto": whether the early draft step pays on THIS engine, measured on its own steps.

    Whether it pays depends on the model: on the built-in tiny model the verify step is too
    short to hide the draft's host work and the early path costs 2-6 % (thirteenth session);
    at DeepSeek-V3 per-rank dims it gains ~15 % (fourteenth session, docs/performance.md). So
    per batch-size bucket (powers of two) the runner's eligible steps are timed in two windows,
    first with the path off, then with it on (the first step of each window, the switch, is not
    counted). The windows are `quick_steps` long first; where they already differ clearly
    (medians `clear_gain` apart and their interquartile ranges disjoint) the faster path is
    kept at once, else both windows are extended to `trial_steps` (off again, then on) and the
    path stays on when the median early step of all its samples is at least `min_gain` faster.
    The trial is run again after `recheck_steps` eligible steps of that bucket. Greedy output
    does not depend on the choice (the early draft is exact).

    Why the quick stage: every trial step on the slower path costs its difference (on the tiny
    model a late step took 1.08 ms against an early 0.645, twenty-seventh session), and a
    clear difference shows in a few steps: two 8-step windows decide it in 18 steps instead of
    66, before a benchmark's 32 warm-up steps end. A close call still gets 32 steps a window."""

    def __init__(self, trial_steps: int = 32, recheck_steps: int = 4096, min_gain: float = 0.01,
                 quick_steps: int | None = 8, clear_gain: float = 0.10):
        quick = trial_steps if quick_steps is None else min(quick_steps, trial_steps)
        if (trial_steps < 2 or quick < 2 or recheck_steps < 1 or not 0.0 <= min_gain < 1.0
                or not min_gain <= clear_gain < 1.0):
            raise ValueError(f"trial_steps={trial_steps}, quick_steps={quick_steps}, "
                             f"recheck_steps={recheck_steps}, min_gain={min_gain}, clear_gain="
                             f"{clear_gain}: need trial_steps >= 2, quick_steps >= 2 (or None), "
                             "recheck_steps >= 1 and 0 <= min_gain <= clear_gain < 1")
        self.trial_steps, self.recheck_steps, self.min_gain = trial_steps, recheck_steps, min_gain
        self.quick_steps, self.clear_gain = quick, clear_gain
        self._trials: dict[int, _Trial] = {}
        # (bucket, median late s, median early s, chose early) of every finished trial
        self.history: list[tuple[int, float, float, bool]] = []

    def _trial(self, num_reqs: int) -> _Trial:
        bucket = _bucket(num_reqs)
        trial = self._trials.get(bucket)
        if trial is None:
            trial = self._trials[bucket] = _Trial({"late": [], "early": []})
        return trial

    @property
    def steps_to_decide(self) -> int:
        """Eligible steps of one bucket from its first to its decision, at most (the quick
        windows, then their extension; each window with its uncounted switch step)."""
        steps = 2 * (self.quick_steps + 1)
        if self.trial_steps > self.quick_steps:
            steps += 2 * (self.trial_steps - self.quick_steps + 1)
        return steps

    @property
    def steps_to_decide_clearly(self) -> int:
        """Eligible steps to a decision where the two paths differ clearly (the quick stage)."""
        return 2 * (self.quick_steps + 1)

    def settled(self, num_reqs: int) -> bool:
        """Whether the trial of `num_reqs`'s bucket has decided (a benchmark that times the
        engine's steady state warms up until it has: scripts' vllm.benchmarks.warmup)."""
        trial = self._trials.get(_bucket(num_reqs))
        return trial is not None and trial.phase == "decided"

    def decision(self, num_reqs: int) -> str:
        """'early', 'late' or 'trial' (undecided) for `num_reqs`'s bucket."""
        if not self.settled(num_reqs):
            return "trial"
        return "early" if self._trials[_bucket(num_reqs)].early else "late"

    def use_early(self, num_reqs: int) -> bool:
        """Whether this eligible step of `num_reqs` rows runs the early path."""
        trial = self._trial(num_reqs)
        return trial.early if trial.phase == "decided" else trial.phase == "early"

    def observe(self, num_reqs: int, early: bool, seconds: float) -> None:
        """The host wall time of an eligible step that ran the path as `early` says."""
        trial = self._trial(num_reqs)
        if trial.phase == "decided":
            trial.steps_decided += 1
            if trial.steps_decided >= self.recheck_steps:
                self._trials[_bucket(num_reqs)] = _Trial({"late": [], "early": []})
            return
        if early != (trial.phase == "early"):
            return  # a step launched before the window switched
        if trial.switching:
            trial.switching = False
            return
        window = trial.samples[trial.phase]
        window.append(seconds)
        if len(window) < (self.quick_steps if trial.stage == 1 else self.trial_steps):
            return
        trial.switching = True
        if trial.phase == "late":
            trial.phase = "early"
            return
        late_s, early_s = trial.samples["late"], trial.samples["early"]
        if (trial.stage == 1 and self.trial_steps > self.quick_steps
                and not _clearly_apart(late_s, early_s, self.clear_gain)):
            trial.stage, trial.phase = 2, "late"
            return
        late, early_m = float(np.median(late_s)), float(np.median(early_s))
        trial.early = early_m <= late * (1.0 - self.min_gain)
        trial.phase = "decided"
        self.history.append((_bucket(num_reqs), late, early_m, trial.early))
