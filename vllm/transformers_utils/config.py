"""Read a model directory's config.json into an attribute-access config object."""
from __future__ import annotations

import copy
import json
import os
from typing import Any

# Fields the DeepSeek-style models read, with the value a config.json that omits them means.
# Explicit values in config.json always win. Routing defaults describe a DeepSeek-V3 router.
_DEFAULTS: dict[str, Any] = {
    "architectures": [],
    "model_type": "deepseek_v3",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "rope_interleave": True,
    "q_lora_rank": None,
    "attention_bias": False,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "n_routed_experts": None,
    "n_shared_experts": None,
    "num_experts_per_tok": None,
    "moe_intermediate_size": None,
    "first_k_dense_replace": 0,
    "moe_layer_freq": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "num_nextn_predict_layers": 0,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
    "torch_dtype": None,
    "max_position_embeddings": 4096,
}


class HFConfig:
    """config.json as attributes: `cfg.hidden_size`, `cfg.get("x", d)`, `"x" in cfg`, `cfg.to_dict()`.

    Keys missing from the file fall back to `_DEFAULTS`; any other missing key raises AttributeError
    so a typo never silently reads None.
    """

    def __init__(self, values: dict[str, Any], path: str | None = None):
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "path", path)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_values", "path"):
            raise AttributeError(name)  # keeps copy / pickle protocols away from config fields
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        if name in _DEFAULTS:
            return copy.deepcopy(_DEFAULTS[name])
        where = object.__getattribute__(self, "path") or "<dict>"
        raise AttributeError(f"config {where} has no field {name!r} (and it has no default)")

    def __setattr__(self, name: str, value: Any) -> None:
        self._values[name] = value

    def __contains__(self, name: str) -> bool:
        return name in self._values or name in _DEFAULTS

    def get(self, name: str, default: Any = None) -> Any:
        if name in self._values:
            return self._values[name]
        return copy.deepcopy(_DEFAULTS.get(name, default)) if name in _DEFAULTS else default

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._values)

    def __reduce__(self):
        return (HFConfig, (self._values, self.path))

    def __repr__(self) -> str:
        return f"HFConfig({self.path or ''}: {self._values!r})"


def load_hf_config(model_dir: str) -> HFConfig:
    """Load `<model_dir>/config.json`. Raises a ValueError naming the path when it is absent."""
    if model_dir is None:
        raise ValueError("load_hf_config needs a model directory, got None; pass --model <dir>")
    path = os.path.join(os.fspath(model_dir), "config.json")
    if not os.path.isfile(path):
        raise ValueError(
            f"no config.json in {model_dir!r}; point the model path at a directory holding "
            "config.json and *.safetensors (write_tiny_models() creates one)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}; fix or "
                         "re-download it") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); is it really a "
                         "config.json?") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(values).__name__}")
    return HFConfig(values, path=os.fspath(model_dir))
