"""What every drafter shares: its own config directory, the target-fit check, and the embedding /
LM head borrowed from the target (held outside the module tree, so they are neither loaded nor
counted twice)."""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from vllm.transformers_utils.config import load_hf_config

DEFAULT_DRAFT_PREFIX = "draft_model"  # keeps draft layer names apart from the target's "model.layers.i"

# Tensors a drafter checkpoint may carry but the drafter takes from the target instead.
SHARED_WITH_TARGET = re.compile(r"^(model\.embed_tokens\.weight|lm_head\.weight|.*shared_head\.head\.weight"
                                r"|model\.layers\.\d+\.embed_tokens\.weight)$")


# DSpark Markov-head variants this implementation runs: bias(prev) = W2(W1[prev]) (rank markov_rank).
MARKOV_HEAD_TYPES = ("low_rank",)


@dataclass(frozen=True)
class BlockDrafterFields:
    """What a DFlash / DSpark config.json says about the block, whichever layout it uses."""
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    markov_rank: int | None = None
    markov_head_type: str | None = None


def _pick(values: dict, where: str, names: list[tuple[str, dict]]):
    """The value of the first present key among (key, dict) pairs; several present must agree."""
    found = [(k, d[k]) for k, d in names if isinstance(d, dict) and k in d]
    if not found:
        return None
    first_key, first = found[0]
    for key, value in found[1:]:
        if value != first:
            raise ValueError(f"{where} sets {first_key}={first!r} and {key}={value!r}; they name the same "
                             "setting, keep one")
    return first


def block_drafter_fields(config, method: str) -> BlockDrafterFields:
    """Read the block-drafter settings in every layout upstream drafters ship:
    * DFlash: top-level `block_size` + nested `dflash_config: {target_layer_ids, mask_token_id}`
      (or the same keys top-level);
    * DSpark: `dspark_target_layer_ids`, `dspark_block_size`, `dspark_noise_token_id`,
      `markov_rank`, `markov_head_type` (or the top-level DFlash-style names)."""
    values = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    where = f"{getattr(config, 'path', None) or 'draft'}/config.json"
    nested = values.get("dflash_config") or {}
    if not isinstance(nested, dict):
        raise ValueError(f"{where}: dflash_config must be a JSON object, got {type(nested).__name__}")
    layer_keys = [("target_layer_ids", values), ("target_layer_ids", nested)]
    block_keys = [("block_size", values), ("block_size", nested)]
    mask_keys = [("mask_token_id", values), ("mask_token_id", nested)]
    if method == "dspark":
        layer_keys.insert(0, ("dspark_target_layer_ids", values))
        block_keys.insert(0, ("dspark_block_size", values))
        mask_keys.insert(0, ("dspark_noise_token_id", values))
    layer_ids = _pick(values, where, layer_keys)
    block = _pick(values, where, block_keys)
    mask = _pick(values, where, mask_keys)
    missing = [keys[0][0] for keys, v in ((layer_keys, layer_ids), (block_keys, block), (mask_keys, mask))
               if v is None]
    if missing:
        layout = ("dspark_target_layer_ids, dspark_block_size and dspark_noise_token_id (or "
                  "target_layer_ids, block_size, mask_token_id)" if method == "dspark" else
                  "block_size and dflash_config: {target_layer_ids, mask_token_id}")
        raise ValueError(f"{where} lacks {missing}; a {method} drafter config needs {layout}")
    if not isinstance(layer_ids, (list, tuple)) or not layer_ids:
        raise ValueError(f"{where}: target_layer_ids={layer_ids!r} must be a non-empty list of layer indices")
    if not isinstance(block, int) or block < 2:
        raise ValueError(f"{where}: block_size={block!r} must be an int >= 2 (anchor + masks)")
    rank = head_type = None
    if method == "dspark":
        rank = values.get("markov_rank")
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"{where}: markov_rank={rank!r} is required for DSpark (the Markov head's rank, "
                             "an int >= 1)")
        head_type = values.get("markov_head_type", "low_rank")
        if head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"{where}: markov_head_type={head_type!r} is not supported; supported: "
                             f"{list(MARKOV_HEAD_TYPES)}")
    return BlockDrafterFields(tuple(int(i) for i in layer_ids), int(block), int(mask), rank, head_type)


def expected_num_speculative_tokens(method: str, block_size: int) -> int:
    """DFlash's block is the anchor + k masks (k = block_size - 1, as z-lab's drafters run);
    DSpark's block is the anchor + k - 1 masks, each row predicting the next token (k = block_size)."""
    return block_size - 1 if method == "dflash" else block_size


def drafter_model_dir(vllm_config) -> str:
    spec = vllm_config.speculative_config
    if spec is None:
        raise ValueError("a drafter needs vllm_config.speculative_config; pass --speculative-config")
    if spec.model:
        return spec.model
    if spec.method == "mtp":  # DeepSeek ships its MTP layer inside the target checkpoint
        return vllm_config.model_config.model
    raise ValueError(f"speculative method {spec.method!r} needs a draft model directory in "
                     "speculative_config.model")


def drafter_config(vllm_config, hf_config):
    return hf_config if hf_config is not None else load_hf_config(drafter_model_dir(vllm_config))


class TargetSharingDrafter(nn.Module):
    """Base class: `share_target(target)` checks fit and borrows embedding + LM head."""

    config = None

    def __init__(self):
        super().__init__()
        self._shared: dict[str, nn.Module] = {}

    def check_target_fit(self, target_config) -> None:
        name = type(self).__name__
        want_hidden = self.config.get("target_hidden_size", self.config.hidden_size)
        if target_config.hidden_size != want_hidden:
            raise ValueError(f"{name} expects a target with hidden_size={want_hidden}, but the target "
                             f"has hidden_size={target_config.hidden_size}; use a drafter trained for this target")
        if target_config.hidden_size != self.config.hidden_size:
            raise ValueError(f"{name} has hidden_size={self.config.hidden_size} but shares the target's "
                             f"embedding of hidden_size={target_config.hidden_size}; the sizes must agree")
        if target_config.vocab_size != self.config.vocab_size:
            raise ValueError(f"{name} has vocab_size={self.config.vocab_size} but the target has "
                             f"vocab_size={target_config.vocab_size}; they must share one vocabulary")

    def share_target(self, target_model) -> None:
        self.check_target_fit(target_model.config)
        self._shared["embed_tokens"] = target_model.model.embed_tokens
        self._shared["lm_head"] = target_model.lm_head

    def _need_shared(self, key: str) -> nn.Module:
        if key not in self._shared:
            raise RuntimeError(f"{type(self).__name__} has no {key}: call share_target(target_model) first")
        return self._shared[key]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._need_shared("embed_tokens")(input_ids)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._need_shared("lm_head").compute_logits(hidden_states)
