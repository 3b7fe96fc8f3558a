"""Async scheduling on the runner side: a launched step whose sampled ids arrive later.

`GPUModelRunner.execute_model_async` enqueues a step (inputs, forward, sampling, the one
device->host copy of the sampled ids) and returns an `AsyncModelRunnerOutput` without waiting
(upstream's name). `get_output()` waits for the copy's event and finishes the host bookkeeping:
the token-id placeholders that the launch appended to the runner's request state are replaced by
the sampled ids. Outputs must be collected in launch order (the runner enforces it).

Two pinned host buffers take turns as the copy target, so step N+1's copy never overwrites step
N's ids before they are read: step N is collected before step N+2 is launched.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from vllm.utils.cuda_streams import record_event
from vllm.v1.outputs import ModelRunnerOutput


@dataclass
class LaunchedStep:
    """What collecting a launched step needs, copied at launch: the InputBatch's host twins are
    rewritten by the next step's preparation before this step is collected."""

    req_ids: list[str]
    sample_rows: list[int]
    # Per sampling row: the RequestState the placeholder was appended to and its index there.
    states: list[Any]
    positions: list[int]
    buffer_index: int
    num_rows: int
    event: torch.cuda.Event | None = None
    logprobs: Any = None
    prompt_logprobs: Any = None


@dataclass
class AsyncModelRunnerOutput:
    """A step's output, ready now (`_output` set) or after its device->host copy completes."""

    _collect: Callable[[], ModelRunnerOutput] | None = None
    _output: ModelRunnerOutput | None = None
    _error: BaseException | None = field(default=None, repr=False)

    @classmethod
    def ready(cls, output: ModelRunnerOutput) -> AsyncModelRunnerOutput:
        return cls(_output=output)

    @property
    def done(self) -> bool:
        return self._output is not None or self._error is not None

    def get_output(self) -> ModelRunnerOutput:
        if self._error is not None:
            raise self._error
        if self._output is None:
            collect, self._collect = self._collect, None
            try:
                self._output = collect()
            except BaseException as error:  # re-raised to every caller, never collected twice
                self._error = error
                raise
        return self._output


class StepOutputBuffers:
    """The step's packed output on the device (`gpu`, written in place: CUDA graphs capture its
    address) and the pinned host targets of its one device->host copy, used in turn, each with
    the event that completes its copy."""

    def __init__(self, rows: int, cols: int, device: torch.device, depth: int = 2):
        self.gpu = torch.zeros(rows, cols, dtype=torch.int64, device=device)
        pin = device.type == "cuda" and torch.cuda.is_available()
        self.cpu = [torch.zeros(rows, cols, dtype=torch.int64, pin_memory=pin)
                    for _ in range(depth)]
        self.np = [t.numpy() for t in self.cpu]
        self.events = ([torch.cuda.Event() for _ in range(depth)]
                       if device.type == "cuda" else [None] * depth)
        self._next = 0

    def launch(self, packed: torch.Tensor) -> tuple[int, torch.cuda.Event | None]:
        """Enqueue the copy of `packed` ([rows, cols] on the device) into the next buffer."""
        index = self._next
        self._next = (index + 1) % len(self.cpu)
        rows = packed.shape[0]
        self.cpu[index][:rows].copy_(packed, non_blocking=True)
        event = self.events[index]
        if event is not None:
            record_event(event)
        return index, event

    def wait(self, index: int, event, rows: int) -> np.ndarray:
        if event is not None:
            event.synchronize()
        return self.np[index][:rows]
