"""DeepSeek-V2 (and V2-Lite): the V3 decoder (MLA, dense-then-MoE layers) with V2's router.

V2 routing: softmax scores, top-k either `greedy` (over all experts) or `group_limited_greedy`
(best `topk_group` groups by their best expert), no correction bias ("noaux" is V3's), weights
times routed_scaling_factor, renormalised only when norm_topk_prob is set (DeepSeek-V2's own code;
its checkpoints set it False). RoPE pairs adjacent dims (V2's complex rotation), which is the
V3 `rope_interleave` layout. Config keys V2 omits are read with V2's meaning, not V3's defaults.
"""
from __future__ import annotations

from vllm.model_executor.models.deepseek_v3 import DeepseekV3ForCausalLM
from vllm.transformers_utils.config import HFConfig

V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def deepseek_v2_config(config) -> HFConfig:
    """A copy of `config` with V2 defaults filled and routing expressed in the shared MoE layer's
    terms. Refuses settings V2 does not have, naming the key."""
    values = config.to_dict()
    where = f"{getattr(config, 'path', None) or '<dict>'}/config.json"
    values.setdefault("scoring_func", "softmax")
    values.setdefault("topk_method", "greedy")
    values.setdefault("norm_topk_prob", False)
    values.setdefault("rope_interleave", True)
    if values["scoring_func"] != "softmax":
        raise ValueError(f"{where}: DeepSeek-V2 routes with scoring_func 'softmax', got "
                         f"{values['scoring_func']!r}")
    method = values["topk_method"]
    if method not in V2_TOPK_METHODS:
        raise ValueError(f"{where}: DeepSeek-V2 topk_method {method!r} is not supported; use one of "
                         f"{list(V2_TOPK_METHODS)} (noaux_tc is DeepSeek-V3's: use DeepseekV3ForCausalLM)")
    n_group, topk_group = int(values.get("n_group") or 1), int(values.get("topk_group") or 1)
    if method == "greedy" or n_group == 1 or topk_group >= n_group:
        # every group is eligible: plain top-k over all experts
        values["n_group"], values["topk_group"] = 1, 1
    else:
        # V2 ranks groups by their best expert; the shared MoE layer ranks them by the sum of
        # their best two (V3). Refuse rather than route differently from the checkpoint.
        raise ValueError(f"{where}: group_limited_greedy with n_group={n_group}, topk_group={topk_group} "
                         "needs group-max scoring, which the MoE layer (fused_moe.select_experts) does not "
                         "provide yet; only greedy / single-group routing is supported for DeepSeek-V2")
    values["model_type"] = "deepseek_v2"
    return HFConfig(values, path=getattr(config, "path", None))


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    def __init__(self, *, vllm_config=None, prefix: str = "", hf_config=None):
        config = hf_config if hf_config is not None else vllm_config.model_config.hf_config
        super().__init__(vllm_config=vllm_config, prefix=prefix, hf_config=deepseek_v2_config(config))
