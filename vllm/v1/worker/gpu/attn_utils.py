"""Attention-metadata assembly: one CommonAttentionMetadata per KV cache group, built per step.

Causality is decided per group because a DFlash/DSpark drafter's layers live in their own
non-causal group (DESIGN §1.3): the same step may build the target group causal and the draft
group non-causal, and a marked group may still build causal batches.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm.utils.env_flags import switch_flag
from vllm.v1.attention.backend import CommonAttentionMetadata

# Graph decode steps with the previous graph step's rows carry its attention metadata over
# (advance_graph_metadata) instead of building it. On by default since its GPU tests passed
# (twenty-sixth session, one H100, scripts/gpu_lean_check.sh); "0" builds every step.
GRAPH_STEP_ADVANCE_FLAG = "VLLM_GRAPH_STEP_ADVANCE"


def graph_step_advance_enabled() -> bool:
    return switch_flag(GRAPH_STEP_ADVANCE_FLAG, True,
                       "graph decode steps with the previous graph step's rows advance its "
                       "attention metadata on the device", "build it on the host every step")


def _rows(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """t[:n], or t itself when it has n rows already (the runner hands batch-sized views; a
    torch slice costs the host ~1.5 us)."""
    if t is None or t.shape[0] == n:
        return t
    return t[:n]


def resolve_group_causality(causal: bool | Mapping[int, bool], num_groups: int) -> list[bool]:
    """Per-group causal flags from a bool (all groups) or a {group_id: bool} map (missing -> True)."""
    if isinstance(causal, bool):
        return [causal] * num_groups
    if not isinstance(causal, Mapping):
        raise ValueError(
            f"causal={causal!r} is invalid: pass a bool or a {{group_id: bool}} mapping.")
    flags = [True] * num_groups
    for group_id, flag in causal.items():
        if not isinstance(group_id, int) or not 0 <= group_id < num_groups:
            raise ValueError(
                f"causal has group id {group_id!r}, but the KV cache config has {num_groups} "
                f"groups; use ids in [0, {num_groups}).")
        flags[group_id] = bool(flag)
    return flags


@dataclass
class KVWriteOnlyMetadata:
    """Forward-context entry of a layer whose KV is written in this forward but whose attention
    does not run (a drafter's layers in the target step: block drafters store the context KV
    there). Only the slot mapping is needed, so no attention plan is built for it."""

    slot_mapping: torch.Tensor


def build_attn_metadata(
    *,
    attn_metadata_builders: Sequence[Any],
    kv_cache_config: Any,
    num_reqs: int,
    num_tokens: int,
    query_start_loc: torch.Tensor,
    query_start_loc_cpu: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    block_tables: Sequence[torch.Tensor],
    slot_mappings: torch.Tensor,
    causal: bool | Mapping[int, bool] = True,
    dcp_local_seq_lens: torch.Tensor | None = None,
    seq_lens_cpu_upper_bound: torch.Tensor | None = None,
    group_ids: Sequence[int] | None = None,
    seq_lens_cpu: torch.Tensor | None = None,
    dcp_local_seq_lens_cpu: torch.Tensor | None = None,
    block_tables_cpu: Sequence[torch.Tensor] | None = None,
    num_blocks_cpu: Sequence[np.ndarray] | None = None,
    cudagraph: bool = False,
    num_computed_tokens_cpu: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Build the per-layer attention metadata of one forward.

    Tensors carry `num_reqs` rows (trailing zero-length rows are padding) and `num_tokens` tokens.
    `block_tables[g]` / `slot_mappings[g]` belong to KV cache group g. `group_ids` restricts the
    build to the groups a model actually has layers in (a drafter's forward needs only its own).
    `seq_lens_cpu` / `num_computed_tokens_cpu` are the exact host twins (prefill metadata is
    planned from them); `block_tables_cpu[g]` / `num_blocks_cpu[g]` the host twin of group g's
    rows and the pages each row holds (host planners). Returns {layer_name: metadata} for every
    layer of the built groups.
    """
    groups = kv_cache_config.kv_cache_groups
    if len(attn_metadata_builders) != len(groups):
        raise ValueError(
            f"got {len(attn_metadata_builders)} metadata builders for {len(groups)} KV cache "
            "groups; build one builder per group.")
    causal_flags = resolve_group_causality(causal, len(groups))
    selected = range(len(groups)) if group_ids is None else group_ids

    # Everything but the block table, slot mapping and causality is the same for every group:
    # slice (and derive) it once per step, not once per group (each torch op on the host costs
    # microseconds, every step).
    qsl = _rows(query_start_loc, num_reqs + 1)
    qsl_cpu = _rows(query_start_loc_cpu, num_reqs + 1)
    seq = _rows(seq_lens, num_reqs)
    dcp_local = _rows(dcp_local_seq_lens, num_reqs)
    upper = _rows(seq_lens_cpu_upper_bound, num_reqs)
    seq_cpu = _rows(seq_lens_cpu, num_reqs)
    if num_computed_tokens_cpu is not None:
        computed_cpu = _rows(num_computed_tokens_cpu, num_reqs)
    elif seq_cpu is None:
        computed_cpu = None
    elif seq_cpu.device.type == "cpu" and qsl_cpu.device.type == "cpu":
        # the same values (and dtype promotion) as the torch expression below, in numpy
        computed_cpu = torch.from_numpy(seq_cpu.numpy() - np.diff(qsl_cpu.numpy()))
    else:
        computed_cpu = seq_cpu - (qsl_cpu[1:] - qsl_cpu[:-1])
    dcp_local_cpu = _rows(dcp_local_seq_lens_cpu, num_reqs)

    attn_metadata: dict[str, Any] = {}
    for group_id in selected:
        common = CommonAttentionMetadata(
            query_start_loc=qsl,
            query_start_loc_cpu=qsl_cpu,
            seq_lens=seq,
            num_reqs=num_reqs,
            num_actual_tokens=num_tokens,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            block_table_tensor=_rows(block_tables[group_id], num_reqs),
            slot_mapping=_rows(slot_mappings[group_id], num_tokens),
            causal=causal_flags[group_id],
            dcp_local_seq_lens=dcp_local,
            seq_lens_cpu_upper_bound=upper,
            seq_lens_cpu=seq_cpu,
            num_computed_tokens_cpu=computed_cpu,
            dcp_local_seq_lens_cpu=dcp_local_cpu,
            block_table_cpu=(None if block_tables_cpu is None
                             else _rows(block_tables_cpu[group_id], num_reqs)),
            num_blocks_cpu=(None if num_blocks_cpu is None
                            else num_blocks_cpu[group_id][:num_reqs]),
            cudagraph=cudagraph,
        )
        metadata = attn_metadata_builders[group_id].build(common_prefix_len=0,
                                                           common_attn_metadata=common)
        for layer_name in groups[group_id].layer_names:
            attn_metadata[layer_name] = metadata
    return attn_metadata


def refresh_attn_metadata_seq_lens(
    *,
    attn_metadata_builders: Sequence[Any],
    kv_cache_config: Any,
    attn_metadata: Mapping[str, Any],
    seq_lens_np: np.ndarray,
    group_ids: Sequence[int] | None = None,
) -> bool:
    """Lower the host lengths of metadata that build_attn_metadata built from upper bounds to
    the exact `seq_lens_np`, group by group, through each builder's refresh_decode_seq_lens
    (FlashInfer MLA plans). False as soon as a built group's builder cannot (no such method,
    or it refuses): the caller then builds again from the exact lengths. Groups refreshed
    before a refusal keep exact lengths, which a new build rewrites anyway."""
    return _each_group_builder(attn_metadata_builders, kv_cache_config, attn_metadata,
                               "refresh_decode_seq_lens", seq_lens_np, group_ids)


def _each_group_builder(builders, kv_cache_config, attn_metadata, method: str, lengths,
                        group_ids, **kwargs) -> bool:
    """builder.<method>(metadata, lengths, **kwargs) for every selected group with layers, in
    order; False at the first builder without the method or refusing (the rest are not
    asked)."""
    groups = kv_cache_config.kv_cache_groups
    selected = range(len(groups)) if group_ids is None else group_ids
    for group_id in selected:
        names = groups[group_id].layer_names
        if not names:
            continue
        metadata = attn_metadata.get(names[0])
        call = getattr(builders[group_id], method, None)
        if metadata is None or call is None or not call(metadata, lengths, **kwargs):
            return False
    return True


def lower_attn_metadata_on_device(
    *,
    attn_metadata_builders: Sequence[Any],
    kv_cache_config: Any,
    attn_metadata: Mapping[str, Any],
    lower_seq_lens_np: np.ndarray,
    group_ids: Sequence[int] | None = None,
) -> bool:
    """refresh_attn_metadata_seq_lens with the exact lengths read on the device, enqueued
    before they are known on the host (each builder's lower_decode_seq_lens_on_device; the
    host gives the lower bound its plans must still fit). False as soon as a group's builder
    cannot: the caller then refreshes or builds from the exact host lengths once it has them,
    which rewrites what the groups lowered before the refusal."""
    return _each_group_builder(attn_metadata_builders, kv_cache_config, attn_metadata,
                               "lower_decode_seq_lens_on_device", lower_seq_lens_np, group_ids)


def advance_attn_metadata_on_device(
    *,
    attn_metadata_builders: Sequence[Any],
    kv_cache_config: Any,
    attn_metadata: Mapping[str, Any],
    lower_seq_lens_np: np.ndarray,
    upper_seq_lens_np: np.ndarray,
    group_ids: Sequence[int] | None = None,
    fuse: Any = None,
) -> bool:
    """lower_attn_metadata_on_device on metadata built for an EARLIER step with the same rows
    (each builder's advance_decode_plan_on_device): this step's exact lengths are read on the
    device, and the host gives both bounds they lie in, which the held plans must fit. False
    as soon as a group's builder cannot: the caller then builds this step's metadata anew,
    which rewrites what the groups advanced before the refusal. `fuse`
    (plan_lowering.FusedDraftLowering): asked before the write of this step's lengths, the
    builders hand it the device work that reads them (the caller performs it with or after
    that write; after a refusal too, as the groups before it would have launched it, and the
    new build then rewrites it)."""
    kwargs = {} if fuse is None else {"fuse": fuse}
    return _each_group_builder(attn_metadata_builders, kv_cache_config, attn_metadata,
                               "advance_decode_plan_on_device",
                               (lower_seq_lens_np, upper_seq_lens_np), group_ids, **kwargs)


def advance_graph_metadata(
    *,
    attn_metadata_builders: Sequence[Any],
    kv_cache_config: Any,
    attn_metadata: Mapping[str, Any],
    seq_lens_np: np.ndarray,
    group_ids: Sequence[int] | None = None,
) -> bool:
    """Carry the attention metadata of an earlier CUDA-graph decode step over to this one
    (same requests in the same rows, same query rows; `seq_lens_np` this step's exact host
    lengths, already in the device buffers the metadata aliases), group by group, through
    each builder's advance_graph_step. False as soon as a group's builder cannot: the caller
    then builds this step's metadata, which rewrites what the groups advanced before."""
    return _each_group_builder(attn_metadata_builders, kv_cache_config, attn_metadata,
                               "advance_graph_step", seq_lens_np, group_ids)
