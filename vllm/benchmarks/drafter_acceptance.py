"""What a block drafter's acceptance allows a speculative engine, measured offline on the CPU.

A DSpark drafter is run on every anchor of the target's own greedy continuation (plain-torch
forwards of tiny_train, float32), and greedy verification is replayed without an engine:

* `accepted_lengths`: per anchor, 1 + the drafts that match the target's argmax before the
  first miss (the bonus token counts, as `mean_acceptance_length` does);
* `walk`: the anchors a greedy engine really visits (it jumps by what it accepted), hence its
  tokens per step, per request. A run of easy anchors is crossed in few steps, so this is lower
  than the mean over every anchor;
* `equal_cost_ceilings`: the tok/s ratio over no drafts that a speculative step costing what a
  plain step costs would give, B = 1 (one request) and for a lock-step batch whose requests all
  decode the same number of tokens (the batch ends with its slowest request).

Used to judge a drafter for issue #10's tiny DSpark target before spending GPU time, and to say
why a target is out of reach (`scripts/drafter_acceptance.py`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from vllm.benchmarks.datasets import spec_bench_prompt
from vllm.model_executor.models import tiny_train as tt


def accepted_lengths(pred: torch.Tensor, gold: torch.Tensor) -> torch.Tensor:
    """[..., k] drafted and target tokens -> [...] tokens a greedy verify step gains (1..k+1)."""
    return 1 + (pred == gold).to(torch.int64).cumprod(-1).sum(-1)


def walk(lengths: list[int]) -> int:
    """Engine steps to decode len(lengths) tokens when anchor i gains lengths[i] tokens."""
    i = steps = 0
    while i < len(lengths):
        i += int(lengths[i])
        steps += 1
    return steps


@dataclass
class AcceptanceSummary:
    per_anchor: list[float]      # per request: mean over every anchor
    tokens_per_step: list[float]  # per request: tokens / steps of the greedy walk
    steps: list[int]              # per request: steps of the walk
    tokens: int                   # tokens each request decodes in the walk

    def equal_cost_ceilings(self) -> dict[str, float]:
        """tok/s over no drafts at a speculative step as cheap as a plain one: request 0 alone
        (B = 1), and the lock-step batch (B = all requests: it takes as many steps as its
        slowest request, a plain batch takes `tokens`)."""
        return {"B=1": self.tokens / self.steps[0],
                f"B={len(self.steps)}": self.tokens / max(self.steps)}


def dspark_acceptance(target_p: dict, target_cfg: dict, draft_p: dict, draft_cfg: dict,
                      prompts: torch.Tensor, output_len: int) -> AcceptanceSummary:
    """Greedy-continue `prompts` [B, P] with the target, then replay what a greedy DSpark engine
    (k = draft_cfg block_size) does for `output_len` tokens: the prefill samples token P, then
    each verify step at anchor a (the last token it holds) gains accepted_lengths tokens, until
    output_len tokens are out (the last step may overshoot: the engine truncates)."""
    b, ctx = prompts.shape
    q = int(draft_cfg["block_size"])
    num_anchors = output_len - 1  # anchors P .. P+output_len-2
    total = ctx + output_len + q  # every anchor's block has its q target tokens
    tables = tt.rope_tables(target_cfg, total + 8)
    draft_tables = tt.rope_tables(draft_cfg, total + 8)
    taps = tuple(draft_cfg["target_layer_ids"])
    with torch.no_grad():
        seqs = tt.generate(target_p, target_cfg, prompts, output_len + q, tables)
        hidden, aux = tt.target_forward(target_p, target_cfg, seqs, tables, aux_layers=taps)
        aux = torch.cat([aux[i] for i in taps], dim=-1)
        labels = tt.lm_logits(target_p, hidden).argmax(-1)  # labels[p] = the target's token p+1
        anchors = torch.arange(ctx, ctx + num_anchors)[None].expand(b, -1)
        block = torch.full((b, num_anchors, q), int(draft_cfg["mask_token_id"]))
        block[:, :, 0] = seqs.gather(1, anchors)
        h = tt.block_drafter_forward(draft_p, draft_cfg, target_p, aux, anchors, block, draft_tables)
        pos = anchors[:, :, None] + torch.arange(q)
        gold = labels.gather(1, pos.flatten(1)).view_as(pos)  # row j drafts token a+j+1
        # the Markov head reads the previous row's token: the anchor, then the drafts, which
        # equal the target's tokens for as long as they are accepted (all that counts here)
        prev = torch.cat([block[:, :, :1], gold[:, :, :-1]], dim=2)
        pred = (tt.lm_logits(target_p, h) + tt.markov_bias(draft_p, prev)).argmax(-1)
    lengths = accepted_lengths(pred, gold)
    steps = [walk(row) for row in lengths.tolist()]
    return AcceptanceSummary(per_anchor=lengths.float().mean(1).tolist(),
                             tokens_per_step=[num_anchors / s for s in steps], steps=steps,
                             tokens=num_anchors)


def benchmark_prompts(batch: int, context: int) -> torch.Tensor:
    """The prompts of vllm.benchmarks.spec_policy (request i, token j)."""
    return torch.tensor([spec_bench_prompt(i, context) for i in range(batch)])


def textwrap_prompts(batch: int, context: int, stride: int = 1500) -> torch.Tensor:
    """Windows of textwrap.py, the stdlib module the tiny family never trained on."""
    data = open(os.path.join(os.path.dirname(os.__file__), "textwrap.py"), "rb").read()
    if (batch - 1) * stride + context > len(data):
        raise ValueError(f"textwrap.py has {len(data)} bytes: too few for {batch} windows of "
                         f"{context} every {stride}")
    return torch.tensor([list(data[i * stride:i * stride + context]) for i in range(batch)])
