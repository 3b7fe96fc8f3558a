"""Built-in tiny DeepSeek-V3-style target and its EAGLE / MTP / DFlash / DSpark drafters.

The trained family ships in the package (tiny_weights/*.safetensors, fp16, made by
scripts/train_tiny.py on text that ships with Python) and is copied to a cache directory on first
use (no hub access, no training):
    paths = write_tiny_models()          # ~/.cache/vllm-dspark/tiny, or $VLLM_TINY_MODEL_DIR
    paths.target, paths.eagle, paths.mtp, paths.dflash, paths.dspark
`write_tiny_models(train_steps=N)` writes the random-weights family instead (test fixture).
The target keeps the real MLA latent dims (kv_lora_rank 512, qk_rope_head_dim 64) so FlashInfer's
MLA kernels accept it, and is small elsewhere so CPU tests run in seconds. The vocabulary is the
256 bytes plus <|bos|> <|eos|> <|pad|> <|mask|>, with a byte-level `tokenizers` tokenizer.json.
Helpers here (config builders, tensor-shape tables, random checkpoints) also build the small
per-test checkpoints of tests/models.
"""
from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass

import torch
from safetensors.torch import save_file

from vllm.transformers_utils.tiktoken_bpe import byte_to_unicode

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|mask|>")
BOS_ID, EOS_ID, PAD_ID, MASK_ID = 256, 257, 258, 259
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
_FORMAT_VERSION = 4  # bump when the written models change, so stale caches are rewritten


@dataclass(frozen=True)
class TinyModelPaths:
    target: str
    eagle: str
    mtp: str
    dflash: str
    dspark: str


# ---------------------------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------------------------
def tiny_target_config(**overrides) -> dict:
    """config.json of the tiny target (Hugging Face DeepseekV3Config field names)."""
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "q_lora_rank": 96,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 64,
        "v_head_dim": 32,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rope_interleave": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
    }
    config.update(overrides)
    return config


def yarn_rope_scaling(factor: float = 4.0, original_max_position_embeddings: int = 1024,
                      mscale: float = 1.0, mscale_all_dim: float = 1.0) -> dict:
    return {"type": "yarn", "rope_type": "yarn", "factor": factor,
            "original_max_position_embeddings": original_max_position_embeddings,
            "beta_fast": 32, "beta_slow": 1, "mscale": mscale, "mscale_all_dim": mscale_all_dim}


def _drafter_base(target: dict) -> dict:
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_scaling",
            "rope_interleave", "attention_bias", "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype")
    base = {k: copy.deepcopy(target[k]) for k in keep}
    base.update(model_type="deepseek_v3", n_routed_experts=None, first_k_dense_replace=0,
                target_hidden_size=target["hidden_size"], target_num_hidden_layers=target["num_hidden_layers"])
    return base


def tiny_eagle_config(target: dict) -> dict:
    return {**_drafter_base(target), "architectures": ["DeepseekEagleForCausalLM"], "num_hidden_layers": 1}


def tiny_mtp_config(target: dict) -> dict:
    # Like DeepSeek-V3: the MTP module is described by the target config with one next-n layer.
    return {**copy.deepcopy(target), "architectures": ["DeepSeekMTPModel"], "num_nextn_predict_layers": 1}


def tiny_dflash_config(target: dict, num_layers: int = 2, block_size: int = 4) -> dict:
    n = target["num_hidden_layers"]
    return {**_drafter_base(target), "architectures": ["DFlashMLAForCausalLM"], "num_hidden_layers": num_layers,
            "target_layer_ids": sorted({0, n // 2, n - 1}), "block_size": block_size, "mask_token_id": MASK_ID}


def tiny_dspark_config(target: dict, num_layers: int = 2, block_size: int = 4,
                       markov_rank: int | None = None) -> dict:
    # markov_rank None = full rank (r = V), so the random family's head can hold the random
    # target's successor table exactly (seed_markov_head); the shipped, trained head uses r = 64.
    rank = target["vocab_size"] if markov_rank is None else markov_rank
    return {**tiny_dflash_config(target, num_layers, block_size), "architectures": ["DSparkMLAForCausalLM"],
            "markov_rank": rank}


# ---------------------------------------------------------------------------------------------
# tensor-shape tables (Hugging Face / DeepSeek checkpoint names), independent of the model code
# ---------------------------------------------------------------------------------------------
def _mla_shapes(c: dict, p: str) -> dict[str, tuple[int, ...]]:
    d, h = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    s: dict[str, tuple[int, ...]] = {}
    if c.get("q_lora_rank") is not None:
        r = c["q_lora_rank"]
        s[f"{p}.q_a_proj.weight"] = (r, d)
        s[f"{p}.q_a_layernorm.weight"] = (r,)
        s[f"{p}.q_b_proj.weight"] = (h * qk, r)
    else:
        s[f"{p}.q_proj.weight"] = (h * qk, d)
    s[f"{p}.kv_a_proj_with_mqa.weight"] = (c["kv_lora_rank"] + c["qk_rope_head_dim"], d)
    s[f"{p}.kv_a_layernorm.weight"] = (c["kv_lora_rank"],)
    s[f"{p}.kv_b_proj.weight"] = (h * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])
    s[f"{p}.o_proj.weight"] = (d, h * c["v_head_dim"])
    return s


def _mlp_shapes(p: str, d: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {f"{p}.gate_proj.weight": (inter, d), f"{p}.up_proj.weight": (inter, d), f"{p}.down_proj.weight": (d, inter)}


def _decoder_layer_shapes(c: dict, p: str, layer_idx: int) -> dict[str, tuple[int, ...]]:
    d = c["hidden_size"]
    s = _mla_shapes(c, f"{p}.self_attn")
    moe = (c.get("n_routed_experts") is not None and layer_idx >= c.get("first_k_dense_replace", 0)
           and layer_idx % c.get("moe_layer_freq", 1) == 0)
    if moe:
        e, mi = c["n_routed_experts"], c["moe_intermediate_size"]
        s[f"{p}.mlp.gate.weight"] = (e, d)
        if c.get("topk_method", "noaux_tc") == "noaux_tc":
            s[f"{p}.mlp.gate.e_score_correction_bias"] = (e,)
        for j in range(e):
            s.update(_mlp_shapes(f"{p}.mlp.experts.{j}", d, mi))
        if c.get("n_shared_experts"):
            s.update(_mlp_shapes(f"{p}.mlp.shared_experts", d, mi * c["n_shared_experts"]))
    else:
        s.update(_mlp_shapes(f"{p}.mlp", d, c["intermediate_size"]))
    s[f"{p}.input_layernorm.weight"] = (d,)
    s[f"{p}.post_attention_layernorm.weight"] = (d,)
    return s


def target_tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    s = {"model.embed_tokens.weight": (c["vocab_size"], c["hidden_size"])}
    for i in range(c["num_hidden_layers"]):
        s.update(_decoder_layer_shapes(c, f"model.layers.{i}", i))
    s["model.norm.weight"] = (c["hidden_size"],)
    if not c.get("tie_word_embeddings"):
        s["lm_head.weight"] = (c["vocab_size"], c["hidden_size"])
    return s


def eagle_tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    d = c["hidden_size"]
    s = {"model.fc.weight": (d, d + c["target_hidden_size"]), "model.enorm.weight": (d,),
         "model.hnorm.weight": (c["target_hidden_size"],)}
    for i in range(c["num_hidden_layers"]):
        s.update(_decoder_layer_shapes(c, f"model.layers.{i}", i))
    s["model.norm.weight"] = (d,)
    return s


def mtp_tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    d, n = c["hidden_size"], c["num_hidden_layers"]
    s: dict[str, tuple[int, ...]] = {}
    for k in range(c["num_nextn_predict_layers"]):
        p = f"model.layers.{n + k}"
        s.update({f"{p}.enorm.weight": (d,), f"{p}.hnorm.weight": (d,), f"{p}.eh_proj.weight": (d, 2 * d),
                  f"{p}.shared_head.norm.weight": (d,)})
        s.update(_decoder_layer_shapes(c, p, n + k))
    return s


def dflash_tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    d = c["hidden_size"]
    s = {"model.fc.weight": (d, len(c["target_layer_ids"]) * c["target_hidden_size"]),
         "model.hidden_norm.weight": (d,)}
    for i in range(c["num_hidden_layers"]):
        s.update(_decoder_layer_shapes(c, f"model.layers.{i}", i))
    s["model.norm.weight"] = (d,)
    return s


def dspark_tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    s = dflash_tensor_shapes(c)
    s["markov_head.w1.weight"] = (c["vocab_size"], c["markov_rank"])
    s["markov_head.w2.weight"] = (c["vocab_size"], c["markov_rank"])
    return s


# ---------------------------------------------------------------------------------------------
# random weights and writing
# ---------------------------------------------------------------------------------------------
def random_weights(shapes: dict[str, tuple[int, ...]], seed: int, logit_scale: float = 3.0) -> dict[str, torch.Tensor]:
    """Deterministic init giving peaked but non-degenerate next-token distributions: unit-variance
    embeddings, fan-in-scaled projections, norm weights near 1, and an LM head whose logits have a
    standard deviation of about `logit_scale` over the normed final hidden state."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(shapes.items()):
        if len(shape) == 1:
            if name.endswith("e_score_correction_bias"):
                t = 0.1 * torch.randn(shape, generator=gen)
            else:
                t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("embed_tokens.weight") or name.endswith("markov_head.w1.weight"):
            t = torch.randn(shape, generator=gen)
        elif name == "lm_head.weight":
            t = torch.randn(shape, generator=gen) * (logit_scale / math.sqrt(shape[1]))
        else:
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
        out[name] = t.contiguous()
    return out


def write_byte_tokenizer(model_dir: str) -> None:
    """tokenizer.json (token id == byte value, specials 256..259) and tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in byte_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.save(os.path.join(model_dir, "tokenizer.json"))
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
                   "bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[1],
                   "pad_token": SPECIAL_TOKENS[2], "mask_token": SPECIAL_TOKENS[3]}, f, indent=2)


def write_checkpoint(model_dir: str, config: dict, tensors: dict[str, torch.Tensor], *,
                     num_shards: int = 1, tokenizer: bool = True) -> str:
    """config.json + model.safetensors (or model-0000i-of-0000n.safetensors + index when sharded)."""
    os.makedirs(model_dir, exist_ok=True)
    names = sorted(tensors)
    if num_shards <= 1:
        save_file({n: tensors[n] for n in names}, os.path.join(model_dir, "model.safetensors"))
    else:
        weight_map = {}
        per = -(-len(names) // num_shards)
        for k in range(num_shards):
            fname = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
            chunk = names[k * per:(k + 1) * per]
            save_file({n: tensors[n] for n in chunk}, os.path.join(model_dir, fname))
            weight_map.update({n: fname for n in chunk})
        with open(os.path.join(model_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    if tokenizer:
        write_byte_tokenizer(model_dir)
    # config last: its presence marks a complete directory
    with open(os.path.join(model_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return model_dir


def write_random_target(model_dir: str, seed: int = 0, num_shards: int = 1, **config_overrides) -> str:
    """A random DeepSeek-V3-style checkpoint (the tiny target with `config_overrides`)."""
    config = tiny_target_config(**config_overrides)
    return write_checkpoint(model_dir, config, random_weights(target_tensor_shapes(config), seed),
                            num_shards=num_shards)


def add_successor_structure(target_weights: dict[str, torch.Tensor], seed: int, alpha: float = 0.3) -> None:
    """Blend into the LM head a fixed successor permutation pi: the row of token pi(v) leans
    towards the embedding of v, so the residual stream's copy of the current token votes for its
    successor. With alpha 0.3 about 70% of greedy steps follow pi and the rest depend on the
    context (mean top probability ~0.57): text with structure a drafter can learn, still
    context-dependent and far from one-hot."""
    gen = torch.Generator().manual_seed(seed + 99)
    embed = target_weights["model.embed_tokens.weight"]
    vocab, hidden = embed.shape
    successor = torch.randperm(vocab, generator=gen)
    source = torch.empty_like(successor)
    source[successor] = torch.arange(vocab)
    head = target_weights["lm_head.weight"]
    target_weights["lm_head.weight"] = ((1 - alpha) * head + alpha * embed[source] * (3.0 / math.sqrt(hidden))).contiguous()
    return successor


def seed_markov_head(dspark_weights: dict[str, torch.Tensor], successor: torch.Tensor,
                     strength: float = 8.0) -> None:
    """Give the tiny DSpark's Markov head the target's successor table: bias(prev) puts
    `strength` logits on successor[prev]. The mask rows of an untrained tiny block drafter carry
    no usable signal, so without this every draft after the first is a guess; with it the
    left-to-right chaining (tok_j from logits_j + bias(tok_{j-1})) is what the acceptance
    statistics show. Needs markov_rank == vocab_size (w1 = identity, w2 = strength * P)."""
    w1, w2 = dspark_weights["markov_head.w1.weight"], dspark_weights["markov_head.w2.weight"]
    vocab, rank = w1.shape
    if rank != vocab:
        raise ValueError(f"seed_markov_head needs markov_rank == vocab_size ({vocab}), got {rank}")
    dspark_weights["markov_head.w1.weight"] = torch.eye(vocab, dtype=w1.dtype)
    table = torch.zeros(vocab, vocab, dtype=w2.dtype)
    table[successor, torch.arange(vocab)] = strength
    dspark_weights["markov_head.w2.weight"] = table


# ---------------------------------------------------------------------------------------------
# the cached tiny model family
# ---------------------------------------------------------------------------------------------
def default_tiny_dir() -> str:
    return os.environ.get("VLLM_TINY_MODEL_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "vllm-dspark", "tiny")


def _is_complete(root: str, names: tuple[str, ...], stamp: dict) -> bool:
    stamp_path = os.path.join(root, "tiny_models.json")
    if not os.path.isfile(stamp_path):
        return False
    with open(stamp_path, encoding="utf-8") as f:
        if json.load(f) != stamp:
            return False
    return all(os.path.isfile(os.path.join(root, n, "config.json")) for n in names)


DEFAULT_TRAIN_STEPS = 20  # distillation steps of the random family when train_steps is asked for
_DRAFTERS = ("eagle", "mtp", "dflash", "dspark")
_NAMES = ("target",) + _DRAFTERS
SHIPPED_SEED = 0  # the seed scripts/train_tiny.py trained the shipped weights with


def shipped_weights_dir() -> str:
    """The trained weights that ship inside the package (written by scripts/train_tiny.py)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_weights")


SHIPPED_MARKOV_RANK = 64  # the trained DSpark head is low rank, as real DSpark checkpoints


def tiny_family_configs(shipped: bool = True) -> dict:
    """name -> (config.json dict, tensor-shape function) of the tiny target and its drafters.
    shipped=False: the random family's, whose DSpark head is full rank (seed_markov_head)."""
    target_cfg = tiny_target_config()
    return {
        "target": (target_cfg, target_tensor_shapes),
        "eagle": (tiny_eagle_config(target_cfg), eagle_tensor_shapes),
        "mtp": (tiny_mtp_config(target_cfg), mtp_tensor_shapes),
        # DFlash's block_size counts the anchor (k = block_size - 1 drafts): 5 = anchor + 4 masks,
        # the block the shipped drafter was trained on.
        "dflash": (tiny_dflash_config(target_cfg, block_size=5), dflash_tensor_shapes),
        "dspark": (tiny_dspark_config(target_cfg, markov_rank=SHIPPED_MARKOV_RANK if shipped else None),
                   dspark_tensor_shapes),
    }


def load_shipped_weights(configs: dict) -> dict[str, dict[str, torch.Tensor]]:
    """The shipped tensors as float32, checked against the current configs' shapes."""
    from safetensors.torch import load_file

    root = shipped_weights_dir()
    out = {}
    for name in _NAMES:
        path = os.path.join(root, f"{name}.safetensors")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"shipped tiny weights {path} are missing (a broken install?); reinstall "
                                    "the package or regenerate them with scripts/train_tiny.py")
        tensors = {k: v.float() for k, v in load_file(path).items()}
        cfg, shapes = configs[name]
        want = shapes(cfg)
        bad = sorted(set(want) ^ set(tensors)) + [k for k in want if k in tensors and tuple(tensors[k].shape) != want[k]]
        if bad:
            raise ValueError(f"shipped {name} weights do not fit tiny_{name}_config (first mismatches: {bad[:3]}); "
                             "the configs changed since training: retrain with scripts/train_tiny.py")
        out[name] = tensors
    return out


def shipped_fingerprint() -> str:
    """Digest of the shipped weight files: a retrained family invalidates every written cache."""
    import hashlib

    digest = hashlib.blake2b(digest_size=8)
    for name in _NAMES:
        path = os.path.join(shipped_weights_dir(), f"{name}.safetensors")
        if os.path.isfile(path):
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


def _distill_memo_dir() -> str:
    return os.environ.get("VLLM_TINY_DISTILL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "vllm-dspark", "distilled")


def _distilled_weights(configs: dict, weights: dict, *, train_steps: int, seed: int) -> dict:
    """Distil once per (format, seed, steps) and memoise the drafter tensors, so every further
    random family written anywhere (tests write many into temporary dirs) costs a file read."""
    from safetensors.torch import load_file

    memo = os.path.join(_distill_memo_dir(), f"v{_FORMAT_VERSION}-seed{seed}-steps{train_steps}")
    files = {name: os.path.join(memo, f"{name}.safetensors") for name in _DRAFTERS}
    if all(os.path.isfile(f) for f in files.values()):
        loaded = {name: load_file(f) for name, f in files.items()}
        fits = all(set(loaded[n]) == set(weights[n]) and
                   all(loaded[n][k].shape == weights[n][k].shape for k in weights[n]) for n in _DRAFTERS)
        if fits:
            return {**weights, **loaded}
    from vllm.model_executor.models.tiny_distill import distill_drafters
    out = distill_drafters(configs, weights, train_steps=train_steps, seed=seed)
    os.makedirs(memo, exist_ok=True)
    for name, path in files.items():
        partial = f"{path}.{os.getpid()}.tmp"
        save_file(out[name], partial)
        os.replace(partial, path)  # atomic: concurrent writers never leave half a file
    return out


def random_family_weights(configs: dict, seed: int, train_steps: int) -> dict:
    """The random-weights family: random target with a successor structure, DSpark's Markov head
    seeded with it, drafters optionally distilled for `train_steps` steps."""
    weights = {name: random_weights(shapes(cfg), seed + k) for k, (name, (cfg, shapes)) in enumerate(configs.items())}
    successor = add_successor_structure(weights["target"], seed)
    seed_markov_head(weights["dspark"], successor)
    if train_steps > 0:
        weights = _distilled_weights(configs, weights, train_steps=train_steps, seed=seed)
    return weights


def write_tiny_models(cache_dir: str | None = None, seed: int = SHIPPED_SEED, force: bool = False,
                      train_steps: int | None = None) -> TinyModelPaths:
    """Write (once) the tiny target and its four drafters under `cache_dir` and return their dirs.

    train_steps=None (default): the trained weights shipped in the package (tiny_weights/, made by
    scripts/train_tiny.py from `seed` 0): a target that continues English and Python text and
    drafters distilled from it. Writing them is a file copy (no training at first use).
    train_steps=N (an int >= 0): the random-weights family from `seed` (the old test fixture:
    random target with a successor structure, DSpark's Markov head seeded from it), its drafters
    distilled for N steps on the random target's continuations (0 = untrained, fastest).
    Idempotent: a complete directory written with the same arguments is reused.
    """
    from tqdm import tqdm

    if train_steps is not None and train_steps < 0:
        raise ValueError(f"train_steps must be None (shipped weights) or >= 0, got {train_steps}")
    if train_steps is None and seed != SHIPPED_SEED:
        raise ValueError(f"the shipped tiny weights were trained with seed {SHIPPED_SEED}, got seed={seed}; "
                         "pass train_steps=0 for a random family with this seed, or retrain with "
                         f"scripts/train_tiny.py --seed {seed}")
    root = os.path.abspath(cache_dir or default_tiny_dir())
    paths = TinyModelPaths(*(os.path.join(root, n) for n in _NAMES))
    stamp = {"format": _FORMAT_VERSION, "seed": seed, "train_steps": train_steps,
             "weights": f"shipped-{shipped_fingerprint()}" if train_steps is None else "random"}
    if not force and _is_complete(root, _NAMES, stamp):
        return paths
    os.makedirs(root, exist_ok=True)
    stamp_path = os.path.join(root, "tiny_models.json")
    if os.path.exists(stamp_path):
        os.remove(stamp_path)

    configs = tiny_family_configs(shipped=train_steps is None)
    if train_steps is None:
        weights = load_shipped_weights(configs)
    else:
        weights = random_family_weights(configs, seed, train_steps)
    for name in tqdm(_NAMES, desc="writing tiny models", unit="model"):
        write_checkpoint(getattr(paths, name), configs[name][0], weights[name])
    with open(stamp_path, "w", encoding="utf-8") as f:
        json.dump(stamp, f)
    return paths
