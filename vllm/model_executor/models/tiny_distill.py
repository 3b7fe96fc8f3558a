"""Short deterministic distillation of the tiny drafters on the tiny target's greedy text.

Only used by `write_tiny_models(train_steps=...)`: it makes drafts agree with the target more
often than chance, so speculative decoding on the tiny model shows real acceptance. Nothing's
correctness depends on it (greedy speculative output equals plain greedy output regardless).

Data: random byte prompts continued greedily by the target; labels are the target's argmax.
  EAGLE / MTP: position p gets (token p+1, target hidden p) and learns the target's choice at p+1
               (the speculator's first draft pass).
  DFlash:      block [x_a, mask...] at a..a+Q-1 over context 0..a-1; mask row j learns token a+j.
  DSpark:      same block; row j learns token a+j+1, with the Markov bias of token a+j added.
Block drafters train with a dense (cache-free) forward: each block attends to its context
prefix and to itself, exactly what the paged non-causal decode computes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm.model_executor.models.weight_loading import checkpoint_tensors_of
from vllm.transformers_utils.config import HFConfig
from vllm.forward_context import dense_attention_context

_PROMPT_LEN, _GEN_LEN, _NUM_SEQS, _BATCH = 8, 40, 20, 4


def _build(cls, config: dict, weights: dict[str, torch.Tensor]):
    model = cls(hf_config=HFConfig(config))
    model.load_weights(weights.items())
    return model


def export_tensors(model, keep: set[str]) -> dict[str, torch.Tensor]:
    """Parameters back to checkpoint names (fused gate_up and stacked experts split again); TP=1 only."""
    out = {}
    for name, param in model.named_parameters():
        for ckpt, piece in checkpoint_tensors_of(name, param):
            out[ckpt] = piece.clone().contiguous()
    missing = keep - set(out)
    if missing:
        raise RuntimeError(f"distillation lost tensors {sorted(missing)[:4]}")
    return {k: out[k] for k in keep}


@torch.no_grad()
def _greedy_decode(target, prompts: list[list[int]], num_new: int) -> list[list[int]]:
    """Batched greedy decoding through the paged MLA cache (TORCH_MLA): one prefill step, then
    one token per sequence per step. Sequence i owns cache block i (block_size >= its length)."""
    from vllm.forward_context import set_forward_context
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.mla.torch_mla import TorchMLAMetadataBuilder

    layers = target.attention_layers()
    n, block = len(prompts), max(len(p) for p in prompts) + num_new
    for layer in layers:
        layer.kv_cache = torch.zeros(n, block, layer.kv_lora_rank + layer.qk_rope_head_dim)
    spec = layers[0].get_kv_cache_spec(block, torch.float32)
    builder = TorchMLAMetadataBuilder(spec, [l.layer_name for l in layers], None, "cpu", dcp_rank=0)
    seqs = [list(p) for p in prompts]
    done = [0] * n
    try:
        for _ in range(num_new + 1):
            ids, pos, slots, qsl = [], [], [], [0]
            for i, s in enumerate(seqs):
                new = range(done[i], len(s))
                ids += s[done[i]:]
                pos += list(new)
                slots += [i * block + p for p in new]
                qsl.append(qsl[-1] + len(new))
            qsl_t = torch.tensor(qsl, dtype=torch.int32)
            seq_lens = torch.tensor([len(s) for s in seqs], dtype=torch.int32)
            cm = CommonAttentionMetadata(
                query_start_loc=qsl_t, query_start_loc_cpu=qsl_t.clone(), seq_lens=seq_lens, num_reqs=n,
                num_actual_tokens=qsl[-1], max_query_len=int((qsl_t[1:] - qsl_t[:-1]).max()),
                max_seq_len=int(seq_lens.max()), block_table_tensor=torch.arange(n, dtype=torch.int32)[:, None],
                slot_mapping=torch.tensor(slots))
            md = builder.build(0, cm)
            with set_forward_context({l.layer_name: md for l in layers}):
                logits = target.compute_logits(target(torch.tensor(ids), torch.tensor(pos)))
            last = logits[qsl_t[1:].long() - 1].argmax(-1).tolist()
            for i, s in enumerate(seqs):
                done[i] = len(s)
                if len(s) < len(prompts[i]) + num_new:
                    s.append(last[i])
            if all(len(s) == len(p) + num_new for s, p in zip(seqs, prompts)) and all(
                    d == len(s) for d, s in zip(done, seqs)):
                break
    finally:
        for layer in layers:
            layer.kv_cache = None
    return seqs


@torch.no_grad()
def _greedy_corpus(target, gen: torch.Generator):
    """Prompt + greedy continuation per sequence, with the target's per-position argmax, final
    hidden states and residual streams at every layer."""
    prompts = [torch.randint(0, 256, (_PROMPT_LEN,), generator=gen).tolist() for _ in range(_NUM_SEQS)]
    data = []
    layers = tuple(range(target.config.num_hidden_layers))
    for ids in _greedy_decode(target, prompts, _GEN_LEN):
        t = torch.tensor(ids)
        with dense_attention_context():
            hidden, aux = target(t, torch.arange(len(ids)), aux_hidden_state_layers=layers)
        data.append({"ids": t, "hidden": hidden, "aux": aux,
                     "argmax": target.compute_logits(hidden).argmax(-1)})
    return data


def _train(model, loss_fn, data, steps: int, gen: torch.Generator, lr: float = 3e-3):
    params = [p for p in model.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    for _ in range(steps):
        batch = torch.randint(0, len(data), (_BATCH,), generator=gen).tolist()
        loss = sum(loss_fn(model, data[i], gen) for i in batch) / len(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    for p in params:
        p.requires_grad_(False)


def _ar_loss(model, seq, gen):
    ids, hidden, labels = seq["ids"], seq["hidden"], seq["argmax"]
    n = len(ids) - 1
    with dense_attention_context():
        h, _ = model(ids[1:], torch.arange(n), hidden[:n])
    return F.cross_entropy(model.compute_logits(h), labels[1:])


def block_dense_forward(model, features, anchors: list[int], block_ids: torch.Tensor) -> torch.Tensor:
    """Block drafter forward without a cache. features [L, D] (context positions 0..L-1), one
    block of Q tokens per anchor a (positions a..a+Q-1, sees context < a and its own block)."""
    nb, q = block_ids.shape
    anchors_t = torch.tensor(anchors)
    block_pos = (anchors_t[:, None] + torch.arange(q)).flatten()
    ctx_pos = torch.arange(features.shape[0])
    block_of = torch.arange(nb).repeat_interleave(q)
    mask = torch.cat([ctx_pos[None, :] < anchors_t[block_of][:, None],          # context prefix
                      block_of[:, None] == block_of[None, :]], dim=1)            # own block
    x = model.embed(block_ids.flatten())
    for layer in model.model.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q_nope, q_pe = attn.project_q(block_pos, h)
        c_blk, pe_blk = attn.project_latent_kv(block_pos, h)
        q_pe, pe_blk = attn.rotary_emb(block_pos, q_pe, pe_blk)
        c_ctx, pe_ctx = attn.rotated_latent_kv(ctx_pos, features)
        qq, k, v = attn._expanded_qkv(q_nope, q_pe, torch.cat([c_ctx, c_blk]), torch.cat([pe_ctx, pe_blk]))
        o = F.scaled_dot_product_attention(qq.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask, scale=attn.scaling).transpose(0, 1)
        x = x + attn.o_proj(o.reshape(len(block_pos), -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.model.norm(x)


def _block_loss_fn(next_token: bool):
    def loss(model, seq, gen):
        ids, labels = seq["ids"], seq["argmax"]
        q = int(model.block_size)
        taps = torch.cat([seq["aux"][i] for i in model.target_layer_ids], dim=-1)
        anchors = torch.randint(_PROMPT_LEN, len(ids) - q - 1, (4,), generator=gen).tolist()
        ctx_len = max(anchors)
        block_ids = torch.full((len(anchors), q), int(model.mask_token_id))
        block_ids[:, 0] = ids[anchors]
        feats = model.context_features(taps[:ctx_len])
        logits = model.compute_logits(block_dense_forward(model, feats, anchors, block_ids)).view(len(anchors), q, -1)
        pos = torch.tensor(anchors)[:, None] + torch.arange(q)
        if next_token:  # DSpark: row j predicts token a+j+1 (target argmax at a+j), Markov bias of a+j
            prev = ids[pos]
            logits = logits + model.markov_logits_bias(prev.flatten()).view_as(logits)
            return F.cross_entropy(logits.flatten(0, 1), labels[pos].flatten())
        # DFlash: mask row j >= 1 predicts the token at a+j (target argmax at a+j-1)
        return F.cross_entropy(logits[:, 1:].flatten(0, 1), labels[pos[:, 1:] - 1].flatten())
    return loss


@torch.no_grad()
def draft_accuracy(method: str, model, data) -> float:
    """Top-1 agreement with the target over the corpus (first draft for EAGLE/MTP, every block
    row for DFlash/DSpark with a fixed anchor grid)."""
    hits = total = 0
    for seq in data:
        ids, labels = seq["ids"], seq["argmax"]
        if method in ("eagle", "mtp"):
            n = len(ids) - 1
            with dense_attention_context():
                h, _ = model(ids[1:], torch.arange(n), seq["hidden"][:n])
            pred, gold = model.compute_logits(h).argmax(-1), labels[1:]
        else:
            q = int(model.block_size)
            taps = torch.cat([seq["aux"][i] for i in model.target_layer_ids], dim=-1)
            anchors = list(range(_PROMPT_LEN, len(ids) - q - 1, q))
            block_ids = torch.full((len(anchors), q), int(model.mask_token_id))
            block_ids[:, 0] = ids[anchors]
            logits = model.compute_logits(block_dense_forward(
                model, model.context_features(taps[:max(anchors)]), anchors, block_ids)).view(len(anchors), q, -1)
            pos = torch.tensor(anchors)[:, None] + torch.arange(q)
            if method == "dspark":
                logits = logits + model.markov_logits_bias(ids[pos].flatten()).view_as(logits)
                pred, gold = logits.argmax(-1), labels[pos]
            else:
                pred, gold = logits[:, 1:].argmax(-1), labels[pos[:, 1:] - 1]
        hits += int((pred == gold).sum())
        total += gold.numel()
    return hits / total


def distill_drafters(configs: dict, weights: dict, *, train_steps: int, seed: int,
                     report: dict | None = None) -> dict:
    """Return `weights` with the four drafters' tensors replaced by distilled ones."""
    from vllm.model_executor.models.deepseek_eagle import DeepseekEagleForCausalLM
    from vllm.model_executor.models.deepseek_mtp import DeepSeekMTP
    from vllm.model_executor.models.deepseek_v3 import DeepseekV3ForCausalLM
    from vllm.model_executor.models.dflash_mla import DFlashMLAForCausalLM
    from vllm.model_executor.models.dspark_mla import DSparkMLAForCausalLM

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only contend
    gen = torch.Generator().manual_seed(seed + 1234)
    try:
        target = _build(DeepseekV3ForCausalLM, configs["target"][0], weights["target"]).eval()
        data = _greedy_corpus(target, gen)
        train, held_out = data[: len(data) * 3 // 4], data[len(data) * 3 // 4:]
        classes = {"eagle": (DeepseekEagleForCausalLM, _ar_loss),
                   "mtp": (DeepSeekMTP, _ar_loss),
                   "dflash": (DFlashMLAForCausalLM, _block_loss_fn(next_token=False)),
                   "dspark": (DSparkMLAForCausalLM, _block_loss_fn(next_token=True))}
        out = dict(weights)
        from tqdm import tqdm
        for method, (cls, loss_fn) in tqdm(classes.items(), desc="distilling tiny drafters", unit="drafter"):
            draft = _build(cls, configs[method][0], weights[method])
            draft.share_target(target)
            before = draft_accuracy(method, draft, held_out)
            _train(draft, loss_fn, train, train_steps, gen)
            after = draft_accuracy(method, draft, held_out)
            kept = after >= before  # a short run can also hurt; then keep the initial weights
            if report is not None:
                report[method] = {"accuracy_before": before, "accuracy_after": after, "kept": kept}
            if kept:
                out[method] = export_tensors(draft, set(weights[method]))
        return out
    finally:
        torch.set_num_threads(previous_threads)
