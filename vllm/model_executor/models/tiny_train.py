"""A plain-torch forward of the tiny DeepSeek-V3 target and its four drafters, for training.

Why a second forward: training needs batched [B, T] sequences, autograd through every weight and
drafter-specific attention masks (EAGLE/MTP training-time unrolling, DFlash/DSpark blocks over a
context prefix), none of which the engine's paged-cache modules are built for. Everything here
works on plain dicts of tensors keyed by the *checkpoint* names (model.layers.0.self_attn.q_a_proj
.weight, ...), so it depends only on the checkpoint format, not on the engine's module layout.
tests/model_executor/test_tiny_train.py pins these forwards to the engine's logits.

Supported subset (what the tiny family uses): q_lora_rank set, no attention bias, no rope
scaling, sigmoid/softmax routing with one expert group, SiLU MLPs.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

Params = dict[str, torch.Tensor]


def check_supported(config: dict) -> None:
    """Raise for config features this training forward does not implement."""
    problems = []
    if config.get("q_lora_rank") is None:
        problems.append("q_lora_rank=None (use a q_lora_rank)")
    if config.get("rope_scaling"):
        problems.append(f"rope_scaling={config['rope_scaling']!r} (use None)")
    if config.get("attention_bias"):
        problems.append("attention_bias=True (use False)")
    if config.get("n_routed_experts") and config.get("n_group", 1) != 1:
        problems.append(f"n_group={config.get('n_group')} (use 1)")
    if problems:
        raise ValueError("tiny_train supports only the tiny family's features; unsupported: " + "; ".join(problems))


# ---------------------------------------------------------------------------------------------
# building blocks
# ---------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_tables(config: dict, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_len, rope_dim/2] as the engine builds them (float32 angles)."""
    dim, base = config["qk_rope_head_dim"], float(config.get("rope_theta") or 10000.0)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, positions: torch.Tensor, tables, interleaved: bool,
               heads: bool) -> torch.Tensor:
    """x [..., T, H, d] (heads=True) or [..., T, d] rotated at `positions`, either [T] (shared by
    the batch) or [B, T] (per row: blocks sit at different positions in each sequence)."""
    cos, sin = tables[0][positions], tables[1][positions]
    if heads:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def gated_mlp(x: torch.Tensor, p: Params, prefix: str) -> torch.Tensor:
    gate = F.linear(x, p[f"{prefix}.gate_proj.weight"])
    up = F.linear(x, p[f"{prefix}.up_proj.weight"])
    return F.linear(F.silu(gate) * up, p[f"{prefix}.down_proj.weight"])


def moe(x: torch.Tensor, p: Params, prefix: str, config: dict, load: list | None = None) -> torch.Tensor:
    """DeepSeek MoE (one group): experts chosen on score + correction bias, weighted by the
    unbiased, renormalised scores times routed_scaling_factor; plus the shared experts.
    `load`, when given, receives each routed expert's token count (for bias balancing)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    logits = F.linear(x.float(), p[f"{prefix}.gate.weight"].float())
    scores = logits.sigmoid() if config["scoring_func"] == "sigmoid" else logits.softmax(-1)
    bias = p.get(f"{prefix}.gate.e_score_correction_bias")
    choice = scores if bias is None else scores + bias.float().detach()
    ids = choice.topk(config["num_experts_per_tok"], dim=-1)[1]
    weights = scores.gather(1, ids)
    if config.get("norm_topk_prob", True):
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    weights = (weights * float(config["routed_scaling_factor"])).to(x.dtype)
    out = torch.zeros_like(x)
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    token_of = order // ids.shape[-1]
    weight_of = weights.flatten()[order]
    counts = torch.bincount(flat, minlength=config["n_routed_experts"]).tolist()
    if load is not None:
        load.append(counts)
    start = 0
    for e, count in enumerate(counts):
        if count:
            idx = token_of[start:start + count]
            y = gated_mlp(x[idx], p, f"{prefix}.experts.{e}") * weight_of[start:start + count, None]
            out = out.index_add(0, idx, y)
            start += count
    if config.get("n_shared_experts"):
        out = out + gated_mlp(x, p, f"{prefix}.shared_experts")
    return out.reshape(shape)


def uses_moe(config: dict, layer_idx: int) -> bool:
    return (config.get("n_routed_experts") is not None and layer_idx >= config.get("first_k_dense_replace", 0)
            and layer_idx % config.get("moe_layer_freq", 1) == 0)


def mla_q(x: torch.Tensor, p: Params, a: str, config: dict, positions, tables) -> torch.Tensor:
    """Per-head queries [B, T, H, nope+rope] with rope applied."""
    h, nope = config["num_attention_heads"], config["qk_nope_head_dim"]
    q = F.linear(rms_norm(F.linear(x, p[f"{a}.q_a_proj.weight"]), p[f"{a}.q_a_layernorm.weight"], 1e-6),
                 p[f"{a}.q_b_proj.weight"])
    q = q.view(*x.shape[:-1], h, nope + config["qk_rope_head_dim"])
    q_pe = apply_rope(q[..., nope:], positions, tables, bool(config["rope_interleave"]), heads=True)
    return torch.cat([q[..., :nope], q_pe], dim=-1)


def mla_kv(x: torch.Tensor, p: Params, a: str, config: dict, positions, tables):
    """Per-head keys [B, T, H, nope+rope] and values [B, T, H, v] of the tokens `x` (the
    non-absorbed form: kv_b expands the normed latent)."""
    h, nope, r = config["num_attention_heads"], config["qk_nope_head_dim"], config["kv_lora_rank"]
    kv = F.linear(x, p[f"{a}.kv_a_proj_with_mqa.weight"])
    c, k_pe = kv[..., :r], kv[..., r:]
    c = rms_norm(c, p[f"{a}.kv_a_layernorm.weight"], config["rms_norm_eps"])
    k_pe = apply_rope(k_pe, positions, tables, bool(config["rope_interleave"]), heads=False)
    kvb = F.linear(c, p[f"{a}.kv_b_proj.weight"]).view(*x.shape[:-1], h, nope + config["v_head_dim"])
    k = torch.cat([kvb[..., :nope], k_pe.unsqueeze(-2).expand(*k_pe.shape[:-1], h, k_pe.shape[-1])], dim=-1)
    return k, kvb[..., nope:]


def attend(q, k, v, mask, config: dict) -> torch.Tensor:
    """q [B, Tq, H, d], k [B, Tk, H, d], v [B, Tk, H, dv]; mask True = visible ([Tq, Tk] or
    [B, Tq, Tk]) or the string "causal". Returns [B, Tq, H*dv]."""
    scale = (config["qk_nope_head_dim"] + config["qk_rope_head_dim"]) ** -0.5
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if isinstance(mask, str):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask if mask.dim() == 2 else mask[:, None],
                                           scale=scale)
    return o.transpose(1, 2).flatten(-2)


def mlp_block(x, p: Params, prefix: str, config: dict, layer_idx: int, load=None):
    h = rms_norm(x, p[f"{prefix}.post_attention_layernorm.weight"], config["rms_norm_eps"])
    if uses_moe(config, layer_idx):
        return x + moe(h, p, f"{prefix}.mlp", config, load)
    return x + gated_mlp(h, p, f"{prefix}.mlp")


def decoder_layer(x, positions, p: Params, prefix: str, config: dict, layer_idx: int, tables,
                  mask="causal", load=None):
    """One DeepSeek layer over whole sequences x [B, T, D] attending to themselves."""
    a = f"{prefix}.self_attn"
    h = rms_norm(x, p[f"{prefix}.input_layernorm.weight"], config["rms_norm_eps"])
    k, v = mla_kv(h, p, a, config, positions, tables)
    o = attend(mla_q(h, p, a, config, positions, tables), k, v, mask, config)
    x = x + F.linear(o, p[f"{a}.o_proj.weight"])
    return mlp_block(x, p, prefix, config, layer_idx, load)


# ---------------------------------------------------------------------------------------------
# target
# ---------------------------------------------------------------------------------------------
def target_forward(p: Params, config: dict, ids: torch.Tensor, tables, *, aux_layers=(), load=None):
    """ids [B, T] -> (final-normed hidden [B, T, D], {layer: residual stream after it})."""
    positions = torch.arange(ids.shape[-1])
    x = F.embedding(ids, p["model.embed_tokens.weight"])
    aux = {}
    for i in range(config["num_hidden_layers"]):
        x = decoder_layer(x, positions, p, f"model.layers.{i}", config, i, tables, load=load)
        if i in aux_layers:
            aux[i] = x
    return rms_norm(x, p["model.norm.weight"], config["rms_norm_eps"]), aux


def lm_logits(p: Params, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden, p["lm_head.weight"])


@torch.no_grad()
def generate(p: Params, config: dict, prompts: torch.Tensor, num_new: int, tables, *,
             temperature: float = 0.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """Continue equal-length prompts [B, P] by `num_new` tokens (greedy at temperature 0, else
    sampled), with a per-layer cache of expanded keys/values. Only byte tokens are produced."""
    n_layers = config["num_hidden_layers"]
    cache_k: list[torch.Tensor | None] = [None] * n_layers
    cache_v: list[torch.Tensor | None] = [None] * n_layers
    seq = prompts.clone()
    step_ids, start = prompts, 0
    for _ in range(num_new):
        t = step_ids.shape[1]
        positions = torch.arange(start, start + t)
        x = F.embedding(step_ids, p["model.embed_tokens.weight"])
        for i in range(n_layers):
            pre = f"model.layers.{i}"
            a = f"{pre}.self_attn"
            h = rms_norm(x, p[f"{pre}.input_layernorm.weight"], config["rms_norm_eps"])
            k, v = mla_kv(h, p, a, config, positions, tables)
            cache_k[i] = k if cache_k[i] is None else torch.cat([cache_k[i], k], dim=1)
            cache_v[i] = v if cache_v[i] is None else torch.cat([cache_v[i], v], dim=1)
            total = cache_k[i].shape[1]
            mask = torch.arange(total)[None, :] <= positions[:, None]  # causal over cache + new
            o = attend(mla_q(h, p, a, config, positions, tables), cache_k[i], cache_v[i], mask, config)
            x = x + F.linear(o, p[f"{a}.o_proj.weight"])
            x = mlp_block(x, p, pre, config, i)
        logits = lm_logits(p, rms_norm(x[:, -1], p["model.norm.weight"], config["rms_norm_eps"]))[:, :256]
        if temperature <= 0:
            nxt = logits.argmax(-1)
        else:
            nxt = torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator)[:, 0]
        seq = torch.cat([seq, nxt[:, None]], dim=1)
        step_ids, start = nxt[:, None], start + t
    return seq


# ---------------------------------------------------------------------------------------------
# drafters
# ---------------------------------------------------------------------------------------------
def unrolled_mask(num_passes: int, t: int) -> torch.Tensor:
    """Visibility for EAGLE/MTP training-time unrolling: [S*T, S*T] over (pass, position).

    Pass 1 is the engine's first draft pass (target hidden states everywhere, causal). Pass s >= 2
    at position p is draft step s-1 of an engine step whose anchor sat at a = p - s + 2: it sees
    pass-1 keys at positions <= p - s + 1 (the accepted prefix) and the pass-j key at position
    p - s + j for j = 2..s (its own earlier draft steps), exactly what the paged cache holds."""
    s_q = torch.arange(1, num_passes + 1).repeat_interleave(t)
    p_q = torch.arange(t).repeat(num_passes)
    s_k, p_k = s_q.clone(), p_q.clone()
    first = (s_k[None, :] == 1) & (p_k[None, :] <= p_q[:, None] - s_q[:, None] + 1)
    later = ((s_k[None, :] >= 2) & (s_k[None, :] <= s_q[:, None])
             & (p_k[None, :] == p_q[:, None] - s_q[:, None] + s_k[None, :]))
    return first | later


def ar_drafter_forward(kind: str, p: Params, config: dict, target_p: Params, ids: torch.Tensor,
                       target_hidden: torch.Tensor, tables, num_passes: int = 1) -> list[torch.Tensor]:
    """EAGLE ("eagle") or MTP ("mtp") drafter, unrolled `num_passes` draft steps.

    ids [B, T] are the target's tokens, target_hidden [B, T, D] its final-normed hidden states.
    Pass 1 at position p reads (token p+1, target hidden p); pass s >= 2 reads (token p+1, pass
    s-1's pre-norm output at p-1). Returns the normed hidden [B, T-1, D] of every pass; logits
    at position p of any pass predict token p+2."""
    eps = config["rms_norm_eps"]
    tok, hid = ids[:, 1:], target_hidden[:, :-1]
    t = tok.shape[1]
    positions = torch.arange(t)
    emb = F.embedding(tok, target_p["model.embed_tokens.weight"])
    if kind == "mtp":
        n = config["num_hidden_layers"]
        pre = f"model.layers.{n}"
        layer_prefixes = [(pre, n)]
        emb = torch.where(positions[None, :, None] == 0, torch.zeros_like(emb), emb)
        enorm, hnorm, proj, final = (f"{pre}.enorm.weight", f"{pre}.hnorm.weight", f"{pre}.eh_proj.weight",
                                     f"{pre}.shared_head.norm.weight")
    elif kind == "eagle":
        layer_prefixes = [(f"model.layers.{i}", i) for i in range(config["num_hidden_layers"])]
        enorm, hnorm, proj, final = ("model.enorm.weight", "model.hnorm.weight", "model.fc.weight",
                                     "model.norm.weight")
    else:
        raise ValueError(f"ar_drafter_forward kind must be 'eagle' or 'mtp', got {kind!r}")
    e = rms_norm(emb, p[enorm], eps)
    keys: list[list[torch.Tensor]] = [[] for _ in layer_prefixes]
    values: list[list[torch.Tensor]] = [[] for _ in layer_prefixes]
    mask = unrolled_mask(num_passes, t)
    outs = []
    prev = hid
    for s in range(num_passes):
        x = F.linear(torch.cat([e, rms_norm(prev, p[hnorm], eps)], dim=-1), p[proj])
        for li, (pre, idx) in enumerate(layer_prefixes):
            a = f"{pre}.self_attn"
            h = rms_norm(x, p[f"{pre}.input_layernorm.weight"], eps)
            k, v = mla_kv(h, p, a, config, positions, tables)
            keys[li].append(k)
            values[li].append(v)
            rows = mask[s * t:(s + 1) * t, :(s + 1) * t]
            o = attend(mla_q(h, p, a, config, positions, tables), torch.cat(keys[li], 1),
                       torch.cat(values[li], 1), rows, config)
            x = x + F.linear(o, p[f"{a}.o_proj.weight"])
            x = mlp_block(x, p, pre, config, idx)
        outs.append(rms_norm(x, p[final], eps))
        # next pass at position p reads this pass's output at p-1 (position 0 has none: zeros)
        prev = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
    return outs


def block_drafter_forward(p: Params, config: dict, target_p: Params, aux: torch.Tensor,
                          anchors: torch.Tensor, block_ids: torch.Tensor, tables) -> torch.Tensor:
    """DFlash/DSpark block forward without a cache.

    aux [B, T, k*D]: the target's residual streams at config.target_layer_ids, concatenated.
    anchors [B, N]: block n of sequence b sits at positions anchors[b, n] + arange(Q) and sees the
    context positions < its anchor and its own block (non-causal), like the paged decode.
    block_ids [B, N, Q]. Returns the normed hidden [B, N, Q, D]."""
    eps = config["rms_norm_eps"]
    b, n, q = block_ids.shape
    t = aux.shape[1]
    feats = rms_norm(F.linear(aux, p["model.fc.weight"]), p["model.hidden_norm.weight"], eps)
    ctx_pos = torch.arange(t)
    block_pos = (anchors[:, :, None] + torch.arange(q)).reshape(b, n * q)
    block_of = torch.arange(n).repeat_interleave(q)
    visible_ctx = ctx_pos[None, None, :] < anchors.repeat_interleave(q, dim=1)[:, :, None]
    own = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)
    mask = torch.cat([visible_ctx, own], dim=2)  # [B, N*Q, T + N*Q]
    x = F.embedding(block_ids.reshape(b, n * q), target_p["model.embed_tokens.weight"])
    for i in range(config["num_hidden_layers"]):
        pre = f"model.layers.{i}"
        a = f"{pre}.self_attn"
        # context KV: the features go straight into kv_a (no input_layernorm), as precompute_context_kv
        k_ctx, v_ctx = mla_kv(feats, p, a, config, ctx_pos, tables)
        h = rms_norm(x, p[f"{pre}.input_layernorm.weight"], eps)
        k_blk, v_blk = mla_kv(h, p, a, config, block_pos, tables)
        qq = mla_q(h, p, a, config, block_pos, tables)
        o = attend(qq, torch.cat([k_ctx, k_blk], 1), torch.cat([v_ctx, v_blk], 1), mask, config)
        x = x + F.linear(o, p[f"{a}.o_proj.weight"])
        x = mlp_block(x, p, pre, config, i)
    return rms_norm(x, p["model.norm.weight"], eps).view(b, n, q, -1)


def markov_bias(p: Params, prev_ids: torch.Tensor) -> torch.Tensor:
    """DSpark's low-rank Markov head: W2 (W1[prev])."""
    return F.linear(F.embedding(prev_ids, p["markov_head.w1.weight"]), p["markov_head.w2.weight"])


def init_std_weights(shapes: dict[str, tuple[int, ...]], seed: int) -> Params:
    """Training init: norms at 1, routing bias 0, embeddings N(0, 1), every projection N(0, 1/fan_in)
    and output projections (o_proj, down_proj) scaled down so the residual stream starts near the
    embedding; the LM head starts small so the initial loss is near uniform."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(shapes.items()):
        if len(shape) == 1:
            t = torch.zeros(shape) if name.endswith("e_score_correction_bias") else torch.ones(shape)
        elif name.endswith("embed_tokens.weight"):
            t = torch.randn(shape, generator=gen)
        elif name == "lm_head.weight":
            t = torch.randn(shape, generator=gen) * (0.5 / math.sqrt(shape[1]))
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            t = torch.randn(shape, generator=gen) * (0.5 / math.sqrt(shape[1]))
        elif name.startswith("markov_head"):
            t = torch.randn(shape, generator=gen) * 0.02
        else:
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
        out[name] = t.contiguous()
    return out
