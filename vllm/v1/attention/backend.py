"""Attention backend interface and the per-group metadata every builder consumes."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class CommonAttentionMetadata:
    """Batch description shared by all layers of one KV cache group for one step.

    Rows are requests in batch order (decode rows first, prefills last). Trailing
    rows with zero query tokens are CUDA-graph padding.
    """

    query_start_loc: torch.Tensor        # [num_reqs+1] int32, device
    query_start_loc_cpu: torch.Tensor    # [num_reqs+1] int32, host twin
    seq_lens: torch.Tensor               # [num_reqs] int32 GLOBAL lengths incl. the current query
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int                     # upper bound of seq_lens
    block_table_tensor: torch.Tensor     # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor           # [num_tokens] int64 (-1 = not stored on this rank)
    causal: bool = True
    dcp_local_seq_lens: torch.Tensor | None = None       # [num_reqs] int32, rank-local (DCP)
    seq_lens_cpu_upper_bound: torch.Tensor | None = None  # [num_reqs] host upper bound
    # Exact host twins (pinned, filled by the runner before the step): builders and planners read
    # these instead of syncing on the device tensors.
    seq_lens_cpu: torch.Tensor | None = None              # [num_reqs] int32 global, exact
    num_computed_tokens_cpu: torch.Tensor | None = None   # [num_reqs] int32 context (seq - query)
    dcp_local_seq_lens_cpu: torch.Tensor | None = None    # [num_reqs] int32 rank-local, exact
    block_table_cpu: torch.Tensor | None = None           # host twin of block_table_tensor
    # [num_reqs] int32 numpy: the pages each row of the block table holds (allocated; entries
    # past them are stale ids). A planner may list pages up to these ahead of the lengths.
    num_blocks_cpu: np.ndarray | None = None
    # True when this batch replays (or is being captured into) a CUDA graph: every shape and
    # buffer address must then be the capture's (padded rows/tokens, fixed bounds).
    cudagraph: bool = False

    def query_lens_cpu(self) -> torch.Tensor:
        qsl = self.query_start_loc_cpu[: self.num_reqs + 1].to(torch.int64)
        return qsl[1:] - qsl[:-1]


class AttentionBackend(ABC):
    """A named backend: metadata builder class + implementation class."""

    # Base of the LSE that impl.forward_decode returns. Every backend here converts
    # to natural log at its boundary, so this is True; kept explicit because the
    # DCP merge silently corrupts results when it assumes the wrong base.
    lse_base_on_e: bool = True

    @staticmethod
    @abstractmethod
    def get_name() -> str: ...

    @staticmethod
    @abstractmethod
    def get_builder_cls() -> type: ...

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type: ...
