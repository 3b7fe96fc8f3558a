"""Test helpers: run a model step by step through the paged MLA cache (TORCH_MLA backend),
building metadata exactly as the runner does (decode rows first, prefills last), and the
Hugging Face oracle on the same checkpoint."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from vllm.forward_context import set_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.selector import get_attn_backend
from vllm.v1.worker.gpu.cp_utils import cp_local_slot


def hf_logits(model_dir: str, token_ids: list[int]) -> torch.Tensor:
    """Full-sequence float32 logits of transformers' DeepseekV3ForCausalLM (the oracle)."""
    import transformers
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0]


@dataclass
class PagedRequest:
    token_ids: list[int]
    chunks: list[int]             # tokens per step; the first chunk is the prefill (from position 0)
    start_step: int = 0           # step at which its prefill is scheduled
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)


class PagedRunner:
    """Allocates a KV cache per attention layer of `model` and runs scheduled chunks."""

    def __init__(self, model, *, block_size: int = 4, num_blocks: int = 64, dcp_size: int = 1,
                 dcp_rank: int = 0, interleave: int = 1, dtype=torch.float32, device="cpu",
                 backend: str = "TORCH_MLA", reorder_batch_threshold: int = 1,
                 context_chunk_tokens: int | None = None):
        self.model = model
        self.device = torch.device(device)
        self.block_size, self.dcp_size, self.dcp_rank, self.interleave = block_size, dcp_size, dcp_rank, interleave
        self.layers = {m.layer_name: m for m in model.modules() if hasattr(m, "get_kv_cache_spec")}
        spec = next(iter(self.layers.values())).get_kv_cache_spec(block_size, dtype)
        for layer in self.layers.values():
            layer.kv_cache = torch.zeros(num_blocks, block_size, 576, dtype=dtype, device=self.device)
        parallel = SimpleNamespace(decode_context_parallel_size=dcp_size, cp_kv_cache_interleave_size=interleave)
        builder_cls = get_attn_backend(backend).get_builder_cls()
        self.builder = builder_cls(spec, list(self.layers), SimpleNamespace(parallel_config=parallel),
                                   self.device, dcp_rank=dcp_rank)
        self.builder.reorder_batch_threshold = reorder_batch_threshold
        if context_chunk_tokens is not None:
            self.builder.prefill_context_chunk_tokens = context_chunk_tokens
        self.next_block = 0
        self.num_blocks = num_blocks

    def _ensure_blocks(self, req: PagedRequest, length: int) -> None:
        virtual = self.block_size * self.dcp_size
        while len(req.block_ids) * virtual < length:
            if self.next_block >= self.num_blocks:
                raise RuntimeError("test ran out of KV blocks; raise num_blocks")
            req.block_ids.append(self.next_block)
            self.next_block += 1

    def build_metadata(self, scheduled: list[tuple[PagedRequest, int]], causal: bool = True):
        """(metadata, input_ids, positions, query_start_loc list) for one step without running it."""
        ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
        max_blocks = 0
        for req, n in scheduled:
            start = req.num_computed
            self._ensure_blocks(req, start + n)
            max_blocks = max(max_blocks, len(req.block_ids))
            ids += req.token_ids[start:start + n]
            p = torch.arange(start, start + n)
            pos.append(p)
            slots.append(cp_local_slot(p, torch.tensor(req.block_ids), self.block_size, self.dcp_size,
                                       self.dcp_rank, self.interleave))
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
        block_table = torch.zeros(len(scheduled), max_blocks, dtype=torch.int32)
        for i, (req, _) in enumerate(scheduled):
            block_table[i, :len(req.block_ids)] = torch.tensor(req.block_ids, dtype=torch.int32)
        qsl_t = torch.tensor(qsl, dtype=torch.int32)
        dev = self.device
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
        local = None
        if self.dcp_size > 1:  # the caller's job: builders require rank-local lengths under DCP
            from vllm.v1.worker.gpu.cp_utils import get_dcp_local_seq_lens
            local = get_dcp_local_seq_lens(seq_lens_t, self.dcp_size, self.dcp_rank,
                                           self.interleave)
        cm = CommonAttentionMetadata(
            query_start_loc=qsl_t.to(dev), query_start_loc_cpu=qsl_t.clone(),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev), num_reqs=len(scheduled),
            num_actual_tokens=qsl[-1], max_query_len=max(n for _, n in scheduled),
            max_seq_len=max(seq_lens), block_table_tensor=block_table.to(dev),
            slot_mapping=torch.cat(slots).to(dev), causal=causal,
            dcp_local_seq_lens=None if local is None else local.to(dev),
            seq_lens_cpu=seq_lens_t, dcp_local_seq_lens_cpu=local,
            block_table_cpu=block_table)
        return self.builder.build(0, cm), torch.tensor(ids, device=dev), torch.cat(pos).to(dev), qsl

    def step(self, scheduled: list[tuple[PagedRequest, int]]) -> None:
        """Run one step; `scheduled` = (request, num_tokens), decode rows (query length <=
        the builder's reorder_batch_threshold) first."""
        metadata, input_ids, positions, qsl = self.build_metadata(scheduled)
        with torch.no_grad(), set_forward_context({name: metadata for name in self.layers}):
            logits = self.model.compute_logits(self.model(input_ids, positions))
        for i, (req, n) in enumerate(scheduled):
            req.logits.append(logits[qsl[i]:qsl[i + 1]].float().cpu())
            req.num_computed += n

    def run(self, requests: list[PagedRequest]) -> list[torch.Tensor]:
        """Schedule every request's chunks (decode rows before prefill rows each step); return the
        concatenated per-position logits of each request."""
        for r in requests:
            if sum(r.chunks) > len(r.token_ids):
                raise ValueError(f"chunks {r.chunks} schedule more than the {len(r.token_ids)} tokens")
        progress = [0] * len(requests)
        step = 0
        while any(progress[i] < len(r.chunks) for i, r in enumerate(requests)):
            decodes, prefills = [], []
            threshold = self.builder.reorder_batch_threshold
            for i, r in enumerate(requests):
                if step >= r.start_step and progress[i] < len(r.chunks):
                    # The builder's split: query length <= threshold = decode row (first).
                    n = r.chunks[progress[i]]
                    (decodes if n <= threshold else prefills).append((r, n))
                    progress[i] += 1
            if decodes or prefills:
                self.step(decodes + prefills)
            step += 1
        return [torch.cat(r.logits) for r in requests]
