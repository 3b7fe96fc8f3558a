"""config.json `architectures` name -> model class."""
from __future__ import annotations

import importlib

_MODELS = {
    "DeepseekV3ForCausalLM": ("deepseek_v3", "DeepseekV3ForCausalLM"),
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


def resolve_model_cls(architectures, method: str | None = None):
    names = list(architectures or [])
    if method is not None:
        if method not in _METHOD_DEFAULTS:
            raise ValueError(f"speculative method {method!r} has no drafter model; use one of {sorted(_METHOD_DEFAULTS)}")
        names = [_METHOD_DEFAULTS[method]]
    for name in names:
        if name in _MODELS:
            module, cls = _MODELS[name]
            return getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), cls)
    raise ValueError(f"model architectures {names} are not supported; supported: {supported_architectures()}")
