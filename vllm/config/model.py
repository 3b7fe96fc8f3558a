"""ModelConfig: which checkpoint, in which dtype, on which device, with which attention backend."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm.config._checks import check_choice, check_positive_int, is_int

_DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
}
ATTENTION_BACKENDS = ("auto", "TORCH_MLA", "FLASHINFER_MLA")


class _MaxModelLenFromHFConfig:
    """Dataclass field descriptor: an unset (None) max_model_len reads as the checkpoint's
    max_position_embeddings, resolved on first read. The model directory may be unknown at
    construction (model=None: the engine substitutes the built-in tiny model later), so it
    cannot be resolved eagerly."""

    def __set_name__(self, owner, name):
        self._slot = "_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            return None  # the dataclass default
        value = obj.__dict__.get(self._slot)
        if value is None and obj.model is not None:
            value = int(obj.hf_config.max_position_embeddings)
            obj.__dict__[self._slot] = value
        return value

    def __set__(self, obj, value):
        if isinstance(value, _MaxModelLenFromHFConfig):  # dataclass passes the default through
            value = None
        check_positive_int("max_model_len", value, optional=True)
        obj.__dict__[self._slot] = value


@dataclass
class ModelConfig:
    model: str | None = None  # model directory; None = the built-in tiny model (set by the engine)
    dtype: str | torch.dtype = "auto"  # auto = bfloat16 on CUDA, float32 on CPU
    max_model_len: int | None = _MaxModelLenFromHFConfig()  # None = max_position_embeddings
    seed: int = 0
    attention_backend: str = "auto"
    device: str = "auto"  # auto = cuda when available, else cpu
    tokenizer: str | None = None  # tokenizer directory; None = the model directory
    enforce_eager: bool = False  # True: never capture/replay CUDA graphs
    quantization: str | None = None  # None = the checkpoint's quantization_config (or none)
    trust_remote_code: bool = False  # let the tokenizer directory run its own Python code
    chat_template: str | None = None  # file (or literal Jinja) overriding the tokenizer's template

    def __post_init__(self):
        # Cache of the loaded config.json; plain attributes, not fields (kept out of asdict/replace).
        self._hf_config: Any = None
        self._hf_config_source: str | None = None
        if self.model is not None and not isinstance(self.model, str):
            self.model = str(self.model)  # accept pathlib.Path
        if self.tokenizer is not None and not isinstance(self.tokenizer, str):
            self.tokenizer = str(self.tokenizer)
        if not isinstance(self.dtype, torch.dtype):
            allowed = ["auto", *_DTYPES]
            self.dtype = check_choice("dtype", self.dtype, allowed)
        elif self.dtype not in _DTYPES.values():
            raise ValueError(f"dtype={self.dtype!r} is invalid: allowed are torch.bfloat16, "
                             "torch.float16 and torch.float32.")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager={self.enforce_eager!r} is invalid: it must be a bool.")
        if not isinstance(self.trust_remote_code, bool):
            raise ValueError(f"trust_remote_code={self.trust_remote_code!r} is invalid: it must be a bool.")
        if self.quantization is not None:
            from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
            self.quantization = check_choice("quantization", self.quantization, QUANTIZATION_METHODS)
        if not is_int(self.seed):
            raise ValueError(f"seed={self.seed!r} is invalid: it must be an int.")
        backend = self.attention_backend
        if not isinstance(backend, str) or backend.upper() not in {b.upper() for b in ATTENTION_BACKENDS}:
            raise ValueError(f"attention_backend={backend!r} is invalid: allowed values are "
                             f"{list(ATTENTION_BACKENDS)}.")
        self.attention_backend = "auto" if backend.lower() == "auto" else backend.upper()
        self._check_device()

    def _check_device(self) -> None:
        device = self.device
        if isinstance(device, torch.device):
            device = str(device)
        ok = isinstance(device, str) and (
            device in ("auto", "cpu", "cuda")
            or (device.startswith("cuda:") and device[5:].isdigit()))
        if not ok:
            raise ValueError(f"device={self.device!r} is invalid: allowed values are 'auto', "
                             "'cpu', 'cuda' or 'cuda:<index>'.")
        self.device = device

    @property
    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]

    @property
    def hf_config(self):
        """The checkpoint's config.json (loaded on first use, reloaded if `model` changes)."""
        if self.model is None:
            raise ValueError("model=None: no checkpoint directory yet. The engine resolves the "
                             "built-in tiny model (vllm.model_executor.models.tiny."
                             "write_tiny_models) before reading hf_config; pass a model directory "
                             "to read it directly.")
        if self._hf_config is None or self._hf_config_source != self.model:
            from vllm.transformers_utils.config import load_hf_config  # heavy, models-owned
            self._hf_config = load_hf_config(self.model)
            self._hf_config_source = self.model
        return self._hf_config

    @property
    def quant_method(self) -> str | None:
        """`quantization`, or the checkpoint's quantization_config.quant_method; unsupported
        methods and conflicts are refused by name."""
        from vllm.model_executor.layers.quantization import resolve_quantization
        return resolve_quantization(self.quantization, self.hf_config.get("quantization_config"),
                                    source=f"{self.model}/config.json")

    @property
    def tokenizer_path(self) -> str | None:
        return self.tokenizer if self.tokenizer is not None else self.model
