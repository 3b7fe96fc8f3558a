"""MTP: DeepSeek's next-n layer used as an autoregressive drafter.

It has EAGLE's forward contract (input_ids, positions, previous hidden) -> (hidden for logits,
hidden for the next step), so it drafts exactly like EAGLE; only the model (chosen by the loader
from the drafter's config) differs.
"""
from __future__ import annotations

from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator


class MTPSpeculator(EagleSpeculator):
    pass
