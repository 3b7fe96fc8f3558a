"""CUDA graphs of uniform decode / verify steps (vLLM's FULL_DECODE_ONLY mode).

A step is graph-eligible when every row is a decode row of exactly Q = 1 + num_speculative_tokens
tokens (plain decode: Q = 1) and the batch fits the largest capture size. It is padded to the next
capture size with trailing zero-length rows (their tokens are PAD slots and see no KV), its
metadata is built against the same persistent buffers the capture used (FlashInfer plans its
graph wrapper on the host), and the captured model forward + LM head replays. Mixed / prefill
steps run eagerly. `--enforce-eager` turns all of this off.
"""
from __future__ import annotations

import bisect
import contextlib
import gc
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)


@dataclass
class CapturedStep:
    graph: torch.cuda.CUDAGraph
    outputs: tuple  # static (hidden, aux_hidden or None, logits) of the capture


@contextlib.contextmanager
def gc_paused():
    """No garbage collection while graphs are captured (upstream freezes the collector for the
    same reason): a collection inside a capture can finalise objects of an earlier runner whose
    teardown makes CUDA calls that are illegal during capture (pinned-memory frees, event or
    graph destruction), which invalidates the capture. torch.cuda.graph collects once on entry;
    this keeps the collector off until every size is captured."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class CudaGraphManager:
    def __init__(self, capture_sizes: list[int], query_len: int, device: torch.device):
        self.capture_sizes = sorted(capture_sizes)
        self.query_len = query_len
        self.device = device
        self.graphs: dict[int, CapturedStep] = {}
        self.pool = None

    @property
    def max_size(self) -> int:
        return self.capture_sizes[-1]

    def padded_num_reqs(self, num_reqs: int) -> int | None:
        """The capture size a batch of num_reqs rows replays with (None: too large)."""
        i = bisect.bisect_left(self.capture_sizes, num_reqs)
        return self.capture_sizes[i] if i < len(self.capture_sizes) else None

    def capture_all(self, prepare: Callable[[int], Any], forward: Callable[[Any], tuple]) -> None:
        """prepare(num_reqs_padded) -> a dummy batch built in graph mode; forward(batch) -> the
        static outputs. Captured largest first so smaller graphs reuse the memory pool."""
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        self.pool = torch.cuda.graph_pool_handle()
        with gc_paused():
            for size in reversed(self.capture_sizes):
                batch = prepare(size)
                forward(batch)  # warm-up: JIT builds, FlashInfer plan of the graph wrapper
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    outputs = forward(batch)
                # One replay now: a graph's first launch uploads it to the device, which would
                # otherwise land on the first serving step of each size and on the speculation
                # cost model's first timing of that step kind. It recomputes the warm-up's dummy
                # batch (same slots, same values), so nothing the capture left changes.
                graph.replay()
                self.graphs[size] = CapturedStep(graph, outputs)
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info("captured %d CUDA graphs (batch sizes %s, Q=%d) in %.2f s using %.1f MiB",
                    len(self.graphs), self.capture_sizes, self.query_len,
                    time.perf_counter() - start, used / 2**20)
        self.capture_seconds = time.perf_counter() - start
        self.capture_bytes = used

    def replay(self, num_reqs_padded: int) -> tuple:
        step = self.graphs[num_reqs_padded]
        step.graph.replay()
        return step.outputs
