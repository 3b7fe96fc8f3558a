"""config.json `architectures` name -> model class."""
from __future__ import annotations

import importlib

_MODELS = {
    "DeepseekV3ForCausalLM": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekEagleForCausalLM": ("deepseek_eagle", "DeepseekEagleForCausalLM"),
    "EagleDeepSeekMTPModel": ("deepseek_eagle", "DeepseekEagleForCausalLM"),
    "DeepSeekMTPModel": ("deepseek_mtp", "DeepSeekMTP"),
    "DFlashMLAForCausalLM": ("dflash_mla", "DFlashMLAForCausalLM"),
    "DSparkMLAForCausalLM": ("dspark_mla", "DSparkMLAForCausalLM"),
}

# speculative method -> drafter architecture (the method decides; a config's architectures may name the target)
_METHOD_DEFAULTS = {
    "eagle": "DeepseekEagleForCausalLM",
    "mtp": "DeepSeekMTPModel",
    "dflash": "DFlashMLAForCausalLM",
    "dspark": "DSparkMLAForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


# model_type -> architecture, for configs whose `architectures` is missing or names a
# remote-code class (Kimi-K2 ships model_type kimi_k2 with DeepSeek-V3 weights)
_MODEL_TYPES = {
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
}


def resolve_model_cls(architectures, method: str | None = None, model_type: str | None = None):
    names = list(architectures or [])
    if model_type in _MODEL_TYPES and not any(n in _MODELS for n in names):
        names.append(_MODEL_TYPES[model_type])
    if method is not None:
        if method not in _METHOD_DEFAULTS:
            raise ValueError(f"speculative method {method!r} has no drafter model; use one of {sorted(_METHOD_DEFAULTS)}")
        names = [_METHOD_DEFAULTS[method]]
    for name in names:
        if name in _MODELS:
            module, cls = _MODELS[name]
            return getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), cls)
    raise ValueError(f"model architectures {names} are not supported; supported: {supported_architectures()}")
