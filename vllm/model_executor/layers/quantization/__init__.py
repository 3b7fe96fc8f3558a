"""Weight quantisation methods. Only block FP8 (`fp8`) is implemented; every other method a
checkpoint or flag names is refused by name (never loaded as if unquantised)."""
from __future__ import annotations

QUANTIZATION_METHODS = ("fp8",)


def resolve_quantization(flag: str | None, hf_quant_config: dict | None, source: str = "config.json") -> str | None:
    """The method to use: `--quantization` if given, else the checkpoint's
    quantization_config.quant_method; None = unquantised. Raises ValueError naming the method."""
    ckpt_method = None
    if hf_quant_config is not None:
        if not isinstance(hf_quant_config, dict):
            raise ValueError(f"{source}: quantization_config must be a JSON object, got "
                             f"{type(hf_quant_config).__name__}")
        ckpt_method = hf_quant_config.get("quant_method")
        if ckpt_method is not None and str(ckpt_method).lower() not in QUANTIZATION_METHODS:
            raise ValueError(f"{source}: quantization method {ckpt_method!r} is not supported; "
                             f"supported: {list(QUANTIZATION_METHODS)}")
        ckpt_method = None if ckpt_method is None else str(ckpt_method).lower()
    if flag is not None:
        method = str(flag).lower()
        if method not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization={flag!r} is not supported; supported: {list(QUANTIZATION_METHODS)}")
        if ckpt_method is not None and ckpt_method != method:
            raise ValueError(f"quantization={flag!r} conflicts with the checkpoint's quant_method "
                             f"{ckpt_method!r} in {source}; drop --quantization or use a matching checkpoint")
        return method
    return ckpt_method


def get_quant_config(method: str | None, hf_quant_config: dict | None, source: str = "config.json"):
    if method is None:
        return None
    if method == "fp8":
        from vllm.model_executor.layers.quantization.fp8 import Fp8Config
        return Fp8Config.from_hf(hf_quant_config, source)
    raise ValueError(f"quantization method {method!r} is not supported; supported: {list(QUANTIZATION_METHODS)}")
