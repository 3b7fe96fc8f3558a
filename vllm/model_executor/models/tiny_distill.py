"""Distil the tiny EAGLE / MTP / DFlash / DSpark drafters from a target's own continuations.

Data: prompts (windows of real text for the trained target, random bytes for a random one) are
continued by the target itself, half greedily and half sampled; the labels are the target's
argmax at every position, i.e. what greedy verification accepts.
  EAGLE / MTP: position p reads (token p+1, target hidden p) and learns the target's choice at p+1;
               training unrolls `num_passes` draft steps (tiny_train.unrolled_mask) so the later
               drafts, which read the drafter's own hidden state, are trained as they run.
  DFlash:      block [x_a, mask x Q-1] at a..a+Q-1 over context < a; row j learns token a+j.
  DSpark:      block [x_a, mask x Q-1]; row j learns token a+j+1 with the Markov bias of token
               a+j added (the anchor for row 0, the target's choice before it for j >= 1); the
               Markov head W2 W1 is trained jointly from its random init.
All forwards are tiny_train's plain-torch ones, on checkpoint-named tensors.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm.model_executor.models import tiny_train as tt

AR_UNROLL = 3  # EAGLE/MTP draft steps trained per position


def generate_corpus(target_p, target_cfg: dict, prompts: torch.Tensor, num_new: int, gen: torch.Generator,
                    *, temperature: float = 0.8, batch: int = 64, progress: bool = False) -> torch.Tensor:
    """Continue each prompt [N, P] by `num_new` target tokens: even chunks greedy, odd sampled."""
    from tqdm import tqdm

    tables = tt.rope_tables(target_cfg, prompts.shape[1] + num_new + 8)
    out = []
    chunks = list(range(0, prompts.shape[0], batch))
    for k, s in enumerate(tqdm(chunks, desc="target continuations", unit="batch", disable=not progress)):
        temp = 0.0 if k % 2 == 0 else temperature
        out.append(tt.generate(target_p, target_cfg, prompts[s:s + batch], num_new, tables,
                               temperature=temp, generator=gen))
    return torch.cat(out)


@torch.no_grad()
def target_features(target_p, target_cfg: dict, seqs: torch.Tensor, aux_layers, batch: int = 64) -> dict:
    """Final-normed hidden, residual streams at `aux_layers` (concatenated) and argmax labels."""
    tables = tt.rope_tables(target_cfg, seqs.shape[1] + 8)
    hidden, aux, labels = [], [], []
    for s in range(0, seqs.shape[0], batch):
        h, a = tt.target_forward(target_p, target_cfg, seqs[s:s + batch], tables, aux_layers=tuple(aux_layers))
        hidden.append(h)
        aux.append(torch.cat([a[i] for i in aux_layers], dim=-1))
        labels.append(tt.lm_logits(target_p, h).argmax(-1))
    return {"ids": seqs, "hidden": torch.cat(hidden), "aux": torch.cat(aux), "argmax": torch.cat(labels)}


# ---------------------------------------------------------------------------------------------
# losses (return (loss, hits, count) so the same code measures top-1 agreement)
# ---------------------------------------------------------------------------------------------
def ar_loss(kind, p, cfg, target_p, data, rows, tables, num_passes=AR_UNROLL):
    ids, hidden, labels = data["ids"][rows], data["hidden"][rows], data["argmax"][rows]
    outs = tt.ar_drafter_forward(kind, p, cfg, target_p, ids, hidden, tables, num_passes=num_passes)
    gold = labels[:, 1:]  # position p of every pass predicts token p+2 = target argmax at p+1
    losses, hits, count = [], 0, 0
    for s, h in enumerate(outs):
        # pass s (0-based) at position p drafts for an anchor at p - s + 1 >= 1
        logits = tt.lm_logits(target_p, h[:, s:])
        g = gold[:, s:]
        losses.append(F.cross_entropy(logits.flatten(0, 1), g.flatten()))
        hits += int((logits.argmax(-1) == g).sum())
        count += g.numel()
    return sum(losses) / len(losses), hits, count


def block_query_len(method: str, cfg: dict) -> int:
    # The block the engine runs: block_size tokens. DFlash = anchor + block_size - 1 masks
    # (k = block_size - 1), DSpark = anchor + k - 1 masks (k = block_size; rows predict the next).
    return int(cfg["block_size"])


def block_loss(method, p, cfg, target_p, data, rows, tables, gen, anchors_per_seq=8, fixed=False,
               row_decay: float | None = None):
    """Cross entropy of every block row against the target's argmax. row_decay (gamma): row j
    of a block weighs exp(-j / gamma) in the loss (hits still count every row the same), since a
    row only counts in a verify step where every row before it was accepted."""
    ids, aux, labels = data["ids"][rows], data["aux"][rows], data["argmax"][rows]
    b, t = ids.shape
    q = block_query_len(method, cfg)
    hi = t - q  # DSpark row q-1 reads label a+q-1 <= t-1; DFlash uses a+q-2
    if fixed:
        anchors = torch.arange(1, hi, q)[None, :].expand(b, -1)
    else:
        anchors = torch.randint(1, hi, (b, anchors_per_seq), generator=gen)
    block = torch.full((b, anchors.shape[1], q), int(cfg["mask_token_id"]))
    block[:, :, 0] = ids.gather(1, anchors)
    h = tt.block_drafter_forward(p, cfg, target_p, aux, anchors, block, tables)
    logits = tt.lm_logits(target_p, h)
    pos = anchors[:, :, None] + torch.arange(q)
    if method == "dspark":
        gold = labels.gather(1, pos.flatten(1)).view_as(pos)                    # row j: argmax at a+j
        prev = torch.cat([block[:, :, :1], gold[:, :, :-1]], dim=2)              # anchor, then gold
        logits = logits + tt.markov_bias(p, prev)
    else:
        logits, gold = logits[:, :, 1:], labels.gather(1, (pos[:, :, 1:] - 1).flatten(1)).view(b, -1, q - 1)
    if row_decay is None:
        loss = F.cross_entropy(logits.flatten(0, 2), gold.flatten())
    else:
        per = F.cross_entropy(logits.flatten(0, 2), gold.flatten(), reduction="none").view_as(gold)
        w = torch.exp(-torch.arange(gold.shape[-1], dtype=per.dtype) / row_decay)
        loss = (per * w).sum() / (w.sum() * per[..., 0].numel())
    return loss, int((logits.argmax(-1) == gold).sum()), gold.numel()


def _loss(method, p, cfg, target_p, data, rows, tables, gen, fixed=False, row_decay=None):
    if method in ("eagle", "mtp"):
        return ar_loss(method, p, cfg, target_p, data, rows, tables)
    return block_loss(method, p, cfg, target_p, data, rows, tables, gen, fixed=fixed,
                      row_decay=row_decay)


@torch.no_grad()
def draft_accuracy(method, p, cfg, target_p, data, tables, gen) -> float:
    """Top-1 agreement with the target's argmax over `data` (every unrolled pass for EAGLE/MTP,
    every block row on a fixed anchor grid for DFlash/DSpark)."""
    hits = total = 0
    for s in range(0, data["ids"].shape[0], 32):
        rows = torch.arange(s, min(s + 32, data["ids"].shape[0]))
        _, h, n = _loss(method, p, cfg, target_p, data, rows, tables, gen, fixed=True)
        hits, total = hits + h, total + n
    return hits / max(total, 1)


def train_drafter(method, weights, cfg, target_p, data, *, steps: int, gen, batch: int = 16,
                  lr: float = 2e-3, progress: bool = False, log: list | None = None,
                  row_decay: float | None = None):
    """AdamW with warm-up and cosine decay on every tensor of the drafter; returns new tensors.
    row_decay: block drafters' row weighting (block_loss); refused for EAGLE / MTP."""
    if row_decay is not None and (method in ("eagle", "mtp") or row_decay <= 0):
        raise ValueError(f"row_decay={row_decay!r} for {method}: a positive gamma, for the block "
                         "drafters (dflash, dspark) only")
    from tqdm import tqdm

    tables = tt.rope_tables(cfg, data["ids"].shape[1] + 16)
    p = {k: v.detach().clone().float().requires_grad_(True) for k, v in weights.items()}
    opt = torch.optim.AdamW(p.values(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warm) * 0.5 * (1 + torch.cos(torch.tensor(min(i, steps) / steps * 3.14159)).item()))
    bar = tqdm(range(steps), desc=f"distilling {method}", unit="step", disable=not progress)
    for i in bar:
        rows = torch.randint(0, data["ids"].shape[0], (batch,), generator=gen)
        loss, hits, count = _loss(method, p, cfg, target_p, data, rows, tables, gen,
                                  row_decay=row_decay)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(p.values(), 1.0)
        opt.step()
        sched.step()
        if log is not None:
            log.append(float(loss.detach()))
        if i % 10 == 0:
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", acc=f"{hits / count:.2f}")
    return {k: v.detach().contiguous() for k, v in p.items()}


DRAFTERS = ("eagle", "mtp", "dflash", "dspark")


def distill_drafters(configs: dict, weights: dict, *, train_steps: int | dict, seed: int, report: dict | None = None,
                     prompts: torch.Tensor | None = None, num_new: int = 96, progress: bool = False,
                     methods: tuple[str, ...] = DRAFTERS, batch: int = 16,
                     row_decay: float | None = None) -> dict:
    """Return `weights` with the drafters' tensors (those named in `methods`; the others are
    returned as given) replaced by ones distilled from the target.

    configs: name -> (config dict, shapes fn or None) for target/eagle/mtp/dflash/dspark; weights:
    name -> checkpoint tensors. train_steps: steps for every drafter, or a dict method -> steps.
    prompts [N, P] byte ids (default: 64 random-byte prompts of 16).
    A quarter of the sequences is held out to measure top-1 agreement before/after; a drafter
    that got worse keeps its input weights (report[name]["kept"] says which happened).
    batch: sequences per optimiser step. row_decay: the block drafters' row weighting
    (block_loss; EAGLE / MTP train unweighted)."""
    unknown = [m for m in methods if m not in DRAFTERS]
    if unknown or not methods:
        raise ValueError(f"methods={methods!r}: choose one or more of {DRAFTERS}")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(min(previous_threads, 2))  # tiny matrices: more threads only contend
    gen = torch.Generator().manual_seed(seed + 1234)
    try:
        target_cfg = configs["target"][0]
        tt.check_supported(target_cfg)
        target_p = {k: v.float() for k, v in weights["target"].items()}
        if prompts is None:
            prompts = torch.randint(0, 256, (64, 16), generator=gen)
        seqs = generate_corpus(target_p, target_cfg, prompts, num_new, gen, progress=progress)
        taps = sorted({i for n in ("dflash", "dspark") for i in configs[n][0]["target_layer_ids"]})
        if any(configs[n][0]["target_layer_ids"] != taps for n in ("dflash", "dspark")):
            raise ValueError("dflash and dspark must tap the same target_layer_ids")
        data = target_features(target_p, target_cfg, seqs, taps)
        n_held = max(1, len(seqs) // 4)
        held = {k: v[:n_held] for k, v in data.items()}
        train = {k: v[n_held:] for k, v in data.items()}
        out = dict(weights)
        for method in methods:
            cfg = configs[method][0]
            tables = tt.rope_tables(cfg, seqs.shape[1] + 16)
            before = draft_accuracy(method, weights[method], cfg, target_p, held, tables, gen)
            log: list[float] = []
            steps = train_steps[method] if isinstance(train_steps, dict) else train_steps
            new = train_drafter(method, weights[method], cfg, target_p, train, steps=steps, gen=gen,
                                progress=progress, log=log, batch=batch,
                                row_decay=row_decay if method in ("dflash", "dspark") else None)
            after = draft_accuracy(method, new, cfg, target_p, held, tables, gen)
            kept = after >= before
            if report is not None:
                report[method] = {"accuracy_before": before, "accuracy_after": after, "kept": kept,
                                  "final_loss": sum(log[-20:]) / max(1, len(log[-20:])) if log else None}
            if kept:
                out[method] = {k: new[k].to(weights[method][k].dtype) for k in weights[method]}
        return out
    finally:
        torch.set_num_threads(previous_threads)
