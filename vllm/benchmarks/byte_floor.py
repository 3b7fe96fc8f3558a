"""The fewest bytes a decode step must move: plain decoding against a block drafter's step.

A decode step at small batch is memory-bound: every weight it uses is read from device memory at
least once, and each request's KV cache once per layer. So the bytes a step must move, over the
copy bandwidth, are a floor on its time. The ratio of two steps' bytes is the lowest time ratio
they can have while both steps' kernels reach the same fraction of that bandwidth: a plain step
that runs further from its floor than the draft side's kernels run from theirs lets the ratio
drop below it. Issue #10 asks for a DSpark overhead factor (t_spec / t_plain, DESIGN §8) of at
most 1.4 on the V3-rank configs; this module says what the configs allow.

What each step reads (bf16 weights as built; counted from the modules' own parameters):
* plain: every target parameter except the embedding table (a step gathers B rows of it), and
  B x context x (kv_lora + rope) KV elements per target layer;
* speculative (DFlash / DSpark, one verify + one draft pass): the plain step's bytes (the verify
  rows read the same weights), plus the drafter's own parameters (its context projection `fc`,
  its layers, a DSpark Markov head), plus the shared LM head once more (the block's logits),
  plus every draft layer's kv_a projection once more (the context-KV write in the target step
  and the block forward in the draft step both read it), plus the drafter's KV per draft layer.
Activations are ignored (a few hundred KB at these batch sizes), so the floor is a lower bound.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def _param_bytes(module: torch.nn.Module, skip: tuple[str, ...] = ()) -> int:
    return sum(p.numel() * p.element_size() for name, p in module.named_parameters()
               if not name.startswith(skip))


@dataclass
class StepBytes:
    plain_weights: int      # target weights a plain step reads
    plain_kv: int           # target KV a plain step reads
    draft_weights: int      # what a speculative step reads on top (weights)
    draft_kv: int           # ... and the drafter's KV
    breakdown: dict[str, int]  # the draft side's weights by part

    @property
    def plain(self) -> int:
        return self.plain_weights + self.plain_kv

    @property
    def speculative(self) -> int:
        return self.plain + self.draft_weights + self.draft_kv

    @property
    def overhead_floor(self) -> float:
        """t_spec / t_plain can be no lower than this on memory-bound steps whose kernels run
        at equal fractions of the copy bandwidth (the module docstring)."""
        return self.speculative / self.plain


def kv_row_bytes(model: torch.nn.Module, dtype_bytes: int) -> int:
    config = model.config
    return (int(config.kv_lora_rank) + int(config.qk_rope_head_dim)) * dtype_bytes


def step_bytes(target: torch.nn.Module, drafter: torch.nn.Module | None, batch: int,
               context: int) -> StepBytes:
    """Bytes of a plain and a block-drafter step at `batch` requests of `context` tokens.
    `target`: a DeepseekV3ForCausalLM-shaped module (model.embed_tokens, model.layers, lm_head);
    `drafter`: a DFlash / DSpark drafter built next to it (model.fc, model.layers, and the
    target's embedding / LM head shared), or None."""
    if batch < 1 or context < 0:
        raise ValueError(f"batch={batch}, context={context}: pass batch >= 1 and context >= 0")
    embed = target.model.embed_tokens.weight
    width = embed.element_size()
    plain_weights = _param_bytes(target, skip=("model.embed_tokens",))
    num_layers = len(target.model.layers)
    row = kv_row_bytes(target, width)
    plain_kv = batch * context * row * num_layers
    if drafter is None:
        return StepBytes(plain_weights, plain_kv, 0, 0, {})
    # The drafter's own parameters by part (its embedding and LM head are the target's, held
    # outside its module tree: drafter_common.TargetSharingDrafter.share_target).
    own: dict[str, int] = {}
    for name, child in drafter.named_children():
        parts = child.named_children() if name == "model" else [(None, child)]
        for sub, module in parts:
            size = _param_bytes(module)
            if size:
                own[name if sub is None else f"{name}.{sub}"] = size
    if sum(own.values()) != _param_bytes(drafter):
        raise ValueError(f"{type(drafter).__name__}: parameters outside its children")
    lm_head = target.lm_head.weight
    own["lm_head (block logits)"] = lm_head.numel() * lm_head.element_size()
    own["kv_a again (context-KV write)"] = sum(
        _param_bytes(layer.self_attn.kv_a_proj_with_mqa) for layer in drafter.model.layers)
    draft_kv = batch * context * row * len(drafter.model.layers)
    return StepBytes(plain_weights, plain_kv, sum(own.values()), draft_kv, own)


def build_models(model_dir: str, draft_dir: str, method: str = "dspark",
                 dtype: str = "bfloat16"):
    """The target and its drafter built from their config.json on the CPU, uninitialised (no
    weights loaded): their parameter shapes are all step_bytes reads."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.loader import (_default_dtype, drafter_model_dir,
                                                         load_hf_config, resolve_model_cls)
    from vllm.model_executor.models.drafter_common import DEFAULT_DRAFT_PREFIX
    args = EngineArgs(model=model_dir, load_format="dummy", device="cpu", dtype=dtype,
                      speculative_config={"method": method, "model": draft_dir,
                                          "num_speculative_tokens": 4})
    config = args.create_engine_config()
    hf = config.model_config.hf_config
    torch_dtype = getattr(torch, dtype)
    with _default_dtype(torch_dtype), torch.device("cpu"):
        target = resolve_model_cls(hf.architectures, model_type=hf.get("model_type"))(
            vllm_config=config, prefix="")
        draft_hf = load_hf_config(drafter_model_dir(config))
        drafter = resolve_model_cls(draft_hf.architectures, method=method)(
            vllm_config=config, prefix=DEFAULT_DRAFT_PREFIX)
    return target, drafter
