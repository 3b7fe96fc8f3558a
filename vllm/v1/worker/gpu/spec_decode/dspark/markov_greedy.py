"""DSpark's greedy draft choice through its Markov head, in one Triton launch on CUDA.

Why: `DSparkSpeculator.select_drafts` chooses the k drafts left to right, each from its block
position's logits plus the Markov head's bias of the previous choice. In torch that is, per
position, an embedding gather, a [r] x [r, V] GEMV, a cast, an add, an argmax and a column
write: ~6 kernels, ~24 at k=4, each a CUDA-graph node of 1.5-3 us however little it computes
(`scripts/graph_kernels.py`, tiny model, B=1: the DSpark step's gathers, GEMVs, argmaxes and
elementwise ops, thirty-third session). Here one program per request row runs the whole chain.

The same drafts as the torch form: the bias is rounded to the head's dtype, then to the logits'
dtype, their sum to the logits' dtype, and the first maximal index is taken (torch.argmax's
rule), as the torch ops do. The one difference is the order of the r-term float32 dot product
(cuBLAS sums in its own order), so a bias can differ in its last bit and a draft at an exact
near-tie may differ; drafts are verified, so no output token changes. A NaN logit: torch's
argmax picks it, this kernel skips it.

Serves greedy draft choice on CUDA for heads of at most _MAX_HEAD_CELLS (V x padded r) cells:
every program reads the head's W2 once per position, which is nothing for the tiny model's
260 x 64 head and too much for a real vocabulary (129K x r), where the torch form's GEMV reads
W2 once for all rows.

On by default (`VLLM_FUSED_MARKOV_DRAFTS=0` keeps the torch ops; read when the speculator is
built). Measured on an H100 (thirty-sixth session, `gpu_validation.sh markov`): the tiny model's
DSpark step at B=1 launches 172.8 kernels instead of 191.8 and spends 393.5 us in them instead of
414.2 (the kernel itself 17.1 us); its GPU tests pass (the torch drafts but for rounding near-ties,
graph replay, DSpark greedy tokens equal plain decoding's with and without it), and so do the
engine-level GPU tests with it on. The tok/s A/B on that node was inside its host noise.

The kernel itself took 17.1 us of that step: one program per row reads all of W2 per draft
position (5 serial [64, 64] tiles for the tiny head). Opt-in, `VLLM_MARKOV_BIAS_TABLE=1` (not
run on a GPU yet): for heads of at most _MAX_TABLE_CELLS (V x V) cells the speculator keeps the
head's whole bias table, table[p] = bias(p) = W2 @ W1[p] in the logits' dtype (one GEMM, rebuilt
when the head's weights change), and a second kernel makes each position one row load, add and
argmax. The table's GEMM may sum in another order than the torch form's GEMV: the same
last-bit near-tie caveat as above.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm.triton_utils import HAS_TRITON, next_pow2, tl, triton  # noqa: F401
from vllm.utils.env_flags import switch_flag

ENV_FLAG = "VLLM_FUSED_MARKOV_DRAFTS"
TABLE_FLAG = "VLLM_MARKOV_BIAS_TABLE"
_MAX_TABLE_CELLS = 1 << 20  # V <= 1024: 2 MiB in bf16
_MAX_HEAD_CELLS = 1 << 16
_MAX_RANK = 256
# one [BLOCK_V, R_PAD] tile of W2 per loop step: at most this many cells
_TILE_CELLS = 1 << 12


def fused_markov_enabled() -> bool:
    return switch_flag(ENV_FLAG, True, "choose DSpark's greedy drafts in one Triton launch on "
                       "CUDA", "use the torch ops (about 6 small kernels a draft position)")


def bias_table_enabled() -> bool:
    return switch_flag(TABLE_FLAG, False, "keep the Markov head's V x V bias table for heads of "
                       "at most 1024 tokens (one row load per draft position)",
                       "read W2 at every draft position")


def bias_table_supported(vocab_size: int) -> bool:
    return 1 <= vocab_size and vocab_size * vocab_size <= _MAX_TABLE_CELLS


def markov_bias_table(w1: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[V, V]: row p is the bias the torch form adds after token p (F.linear's output in the
    head's dtype, then cast to the logits' `dtype`)."""
    return F.linear(w1, w2).to(dtype).contiguous()


def markov_greedy_supported(vocab_size: int, rank: int) -> bool:
    """Whether markov_greedy_drafts serves a head of `vocab_size` rows of rank `rank`."""
    return 1 <= rank <= _MAX_RANK and vocab_size >= 1 and (
        vocab_size * max(next_pow2(rank), 2) <= _MAX_HEAD_CELLS)


def uses_fused_markov(enabled: bool, device_type: str, greedy: bool, vocab_size: int,
                      rank: int) -> bool:
    """The speculator's choice: the kernel where it is switched on, on CUDA, for greedy draft
    choice (probabilistic drafting samples and keeps q, which the torch form does) and a head
    the kernel serves; the torch form otherwise."""
    return (enabled and device_type == "cuda" and greedy
            and markov_greedy_supported(vocab_size, rank))


if HAS_TRITON:

    @triton.jit
    def _chain_start(logits_ptr, stride_lb, anchors_ptr, V):
        """(this program's row, its anchor, its logits row): one program per request row."""
        b = tl.program_id(0).to(tl.int64)
        # a padding row's anchor is a valid id already; the clamp only keeps a bad one in bounds
        prev = tl.minimum(tl.maximum(tl.load(anchors_ptr + b).to(tl.int64), 0), V - 1)
        return b, prev, logits_ptr + b * stride_lb

    @triton.jit
    def _biased_max(logit, bias, offs_v, v_ok, V):
        """(maximum, its first index) of logit + bias over the valid lanes: the add in the
        logits' dtype (computed in float32 and rounded, as torch does), torch.argmax's rule."""
        biased = (logit.to(tl.float32) + bias.to(tl.float32)).to(logit.dtype).to(tl.float32)
        biased = tl.where(v_ok, biased, float("-inf"))
        m = tl.max(biased, axis=0)
        return m, tl.min(tl.where(biased == m, offs_v, V), axis=0).to(tl.int64)

    @triton.jit
    def _markov_greedy_kernel(logits_ptr, stride_lb, stride_lq, anchors_ptr, w1_ptr, w2_ptr,
                              out_ptr, stride_ob, V, R: tl.constexpr, R_PAD: tl.constexpr,
                              K: tl.constexpr, BLOCK_V: tl.constexpr):
        b, prev, row = _chain_start(logits_ptr, stride_lb, anchors_ptr, V)
        offs_r = tl.arange(0, R_PAD)
        r_ok = offs_r < R
        for j in tl.static_range(K):
            emb = tl.load(w1_ptr + prev * R + offs_r, mask=r_ok, other=0.0).to(tl.float32)
            best_val = tl.full([], float("-inf"), tl.float32)
            best_idx = tl.full([], 0, tl.int64)
            for v0 in range(0, V, BLOCK_V):
                offs_v = v0 + tl.arange(0, BLOCK_V)
                v_ok = offs_v < V
                w2 = tl.load(w2_ptr + offs_v[:, None].to(tl.int64) * R + offs_r[None, :],
                             mask=v_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
                # F.linear's output in the head's dtype, then .to(logits.dtype)
                bias = tl.sum(w2 * emb[None, :], axis=1)
                bias = bias.to(w2_ptr.dtype.element_ty).to(logits_ptr.dtype.element_ty)
                logit = tl.load(row + j * stride_lq + offs_v, mask=v_ok, other=0.0)
                m, first = _biased_max(logit, bias, offs_v, v_ok, V)
                better = m > best_val  # strictly: an equal value later keeps the first index
                best_idx = tl.where(better, first, best_idx)
                best_val = tl.where(better, m, best_val)
            tl.store(out_ptr + b * stride_ob + j, best_idx)
            prev = best_idx

    @triton.jit
    def _markov_table_kernel(logits_ptr, stride_lb, stride_lq, anchors_ptr, table_ptr, out_ptr,
                             stride_ob, V, K: tl.constexpr, BLOCK_V: tl.constexpr):
        b, prev, row = _chain_start(logits_ptr, stride_lb, anchors_ptr, V)
        offs_v = tl.arange(0, BLOCK_V)
        v_ok = offs_v < V
        for j in tl.static_range(K):
            bias = tl.load(table_ptr + prev * V + offs_v, mask=v_ok, other=0.0)
            logit = tl.load(row + j * stride_lq + offs_v, mask=v_ok, other=0.0)
            prev = _biased_max(logit, bias, offs_v, v_ok, V)[1]
            tl.store(out_ptr + b * stride_ob + j, prev)


def markov_greedy_drafts(logits: torch.Tensor, anchors: torch.Tensor, w1: torch.Tensor,
                         w2: torch.Tensor) -> torch.Tensor:
    """drafts [B, K] int64 from block logits [B, K, V], anchors [B] and the Markov head's
    w1, w2 [V, r]: tok_0 = argmax(logits_0 + w2 @ w1[anchor]), tok_j = argmax(logits_j +
    w2 @ w1[tok_{j-1}]). The caller has checked markov_greedy_supported."""
    num_rows, k, vocab = logits.shape
    rank = w1.shape[1]
    if w1.shape != w2.shape or w1.shape[0] != vocab:
        raise ValueError(f"Markov head w1 {tuple(w1.shape)} / w2 {tuple(w2.shape)} do not "
                         f"match logits of vocabulary {vocab}: both must be [{vocab}, r]")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    w1, w2 = w1.contiguous(), w2.contiguous()
    out = torch.empty(num_rows, k, dtype=torch.int64, device=logits.device)
    if num_rows == 0 or k == 0:
        return out
    r_pad = max(next_pow2(rank), 2)
    block_v = max(min(next_pow2(vocab), _TILE_CELLS // r_pad), 16)
    _markov_greedy_kernel[(num_rows,)](
        logits, logits.stride(0), logits.stride(1), anchors, w1, w2, out, out.stride(0), vocab,
        R=rank, R_PAD=r_pad, K=k, BLOCK_V=block_v, num_warps=4)
    return out


def markov_table_drafts(logits: torch.Tensor, anchors: torch.Tensor,
                        table: torch.Tensor) -> torch.Tensor:
    """markov_greedy_drafts from the head's bias table (markov_bias_table, in the logits'
    dtype): drafts [B, K] int64. The caller has checked bias_table_supported."""
    num_rows, k, vocab = logits.shape
    if table.shape != (vocab, vocab) or table.dtype != logits.dtype:
        raise ValueError(f"Markov bias table {tuple(table.shape)} {table.dtype} does not match "
                         f"logits of vocabulary {vocab} in {logits.dtype}: rebuild it with "
                         "markov_bias_table(w1, w2, logits.dtype)")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(num_rows, k, dtype=torch.int64, device=logits.device)
    if num_rows == 0 or k == 0:
        return out
    block_v = max(next_pow2(vocab), 16)
    _markov_table_kernel[(num_rows,)](
        logits, logits.stride(0), logits.stride(1), anchors, table.contiguous(), out,
        out.stride(0), vocab, K=k, BLOCK_V=block_v, num_warps=4 if block_v <= 512 else 8)
    return out
