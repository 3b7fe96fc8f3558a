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

`VLLM_EARLY_DRAFT_METADATA`: "0" (default: never), "auto" (with a captured greedy draft step
and builders that lower lengths in place: FlashInfer MLA at DCP 1), "1" (wherever the step
allows: uniform decode or verify rows that all sample, DCP 1; eager steps then build twice,
which is how the CPU tests exercise it).

Measured (thirteenth session, one H200, tiny model, DSpark k=4, bf16, graphs, synchronous,
`scripts/probe_early_draft.py`, engines stepped in turn in one process): "auto" against "0"
0.980x tok/s at B=1 and 0.941x at B=8, greedy tokens identical; 134 of 139 early steps
(B=1) and 205 of 267 (B=8) were lowered in place, the rest built again. The tiny model's
verify step is too short for the host work to hide in it, and the lowering and the second
builds cost more than the overlap wins, so it is off by default. Where the verify step's GPU
time exceeds the draft's host work (large models) it may pay; not measured yet.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

ENV_FLAG = "VLLM_EARLY_DRAFT_METADATA"
MODES = ("auto", "1", "0")


def early_draft_mode() -> str:
    value = os.environ.get(ENV_FLAG, "0")
    if value not in MODES:
        raise ValueError(f"{ENV_FLAG}={value!r} is invalid: use 0 (default: never), auto (with "
                         "captured draft steps and FlashInfer MLA at DCP 1) or 1 (wherever the "
                         "step allows, e.g. to test it eagerly)")
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
