"""A vLLM-shaped engine slice for MLA models with speculative decoding under Decode Context Parallelism.

Top-level names are imported lazily so that `import vllm` stays cheap (the CLI and the tests import
sub-modules directly).
"""
from importlib import import_module

__version__ = "0.1.0"

_LAZY_EXPORTS = {
    "LLM": "vllm.entrypoints.llm",
    "SamplingParams": "vllm.sampling_params",
    "RequestOutput": "vllm.outputs",
    "CompletionOutput": "vllm.outputs",
    "EngineArgs": "vllm.engine.arg_utils",
}

__all__ = ["__version__", *_LAZY_EXPORTS]


def __getattr__(name: str):
    module_name = _LAZY_EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'vllm' has no attribute {name!r}")
    return getattr(import_module(module_name), name)
