"""A stand-in model forward for host-cost probes (scripts/probe_host_step.py,
scripts/diff_step_profiles.py --stub-forward).

Why: on a CPU box the model forward takes milliseconds and hides the engine's own host work,
which on a GPU node (graph replay, one launch) is most of a small model's step. The stub
returns persistent zero hidden states and fixed logits (greedy picks one token in every row),
with no per-step allocation, so what is timed is scheduling, input preparation, attention
metadata, sampling, the output path and the request bookkeeping. A speculative engine's
context-KV write (inside the forward on a GPU, in its graph) is skipped with it; drafts are
never verified against these logits (use it for engines whose policy lets nobody draft)."""
from __future__ import annotations

import torch


def stub_forward(runner, token: int = 7) -> None:
    """Replace `runner._forward` by fixed outputs."""
    hf = runner.vllm_config.model_config.hf_config
    vocab, hidden = int(hf.vocab_size), int(hf.hidden_size)
    n = runner.max_num_tokens
    zeros = torch.zeros(n, hidden, dtype=runner.kv_dtype, device=runner.device)
    logits = torch.zeros(n, vocab, dtype=torch.float32, device=runner.device)
    logits[:, token] = 1.0

    def forward(batch):
        rows = batch.num_tokens_padded if batch.cudagraph else len(batch.logits_indices)
        return zeros[: batch.num_tokens_padded], None, logits[:rows]

    runner._forward = forward
