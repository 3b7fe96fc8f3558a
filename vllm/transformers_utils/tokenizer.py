"""Tokenizers from a local directory (no hub access), through Hugging Face transformers.

* tokenizer.json / tokenizer_config.json: `transformers.AutoTokenizer.from_pretrained(dir,
  local_files_only=True)`; a tokenizer that needs its own Python code (`auto_map`) loads only with
  `trust_remote_code=True` (`--trust-remote-code`).
* Kimi-style `tiktoken.model` (+ tokenization_kimi.py, no tokenizer.json): rebuilt as an equivalent
  byte-level BPE with the `tokenizers` library (tiktoken_bpe.py), special tokens from
  tokenizer_config.json, wrapped in a PreTrainedTokenizerFast: no remote code runs.
* Chat template: `chat_template` (a file path or literal Jinja, `--chat-template`) overrides the
  tokenizer's own (tokenizer_config.json `chat_template` or chat_template.jinja).

`get_tokenizer` returns a `Tokenizer` exposing what the engine uses (encode/decode, special ids,
`apply_chat_template`) plus `backend` (the `tokenizers.Tokenizer`, for DecodeStream).
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence

from vllm.transformers_utils.tiktoken_bpe import build_tiktoken_tokenizer, load_tiktoken_ranks

TIKTOKEN_FILE = "tiktoken.model"


class Tokenizer:
    """Engine-facing view of a transformers tokenizer (`.hf`)."""

    def __init__(self, hf_tokenizer, source: str):
        self.hf = hf_tokenizer
        self.source = source
        self.bos_token_id = hf_tokenizer.bos_token_id
        self.eos_token_id = hf_tokenizer.eos_token_id
        self.pad_token_id = hf_tokenizer.pad_token_id
        self.all_special_ids = set(hf_tokenizer.all_special_ids)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    @property
    def backend(self):
        """The underlying `tokenizers.Tokenizer` (None for slow, pure-Python tokenizers)."""
        return getattr(self.hf, "backend_tokenizer", None)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def __len__(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return list(self.hf.convert_ids_to_tokens(list(ids)))

    def token_to_id(self, token: str) -> int | None:
        token_id = self.hf.convert_tokens_to_ids(token)
        return None if token_id is None or token_id == self.hf.unk_token_id and token != self.hf.unk_token \
            else token_id

    def apply_chat_template(self, messages, tokenize: bool = False, add_generation_prompt: bool = True, **kwargs):
        return self.hf.apply_chat_template(messages, tokenize=tokenize,
                                           add_generation_prompt=add_generation_prompt, **kwargs)


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def _token_content(entry) -> str | None:
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("content"), str):
        return entry["content"]
    raise ValueError(f"unrecognised special-token entry {entry!r} in tokenizer_config.json")


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a path to a Jinja file, or the template text itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat_template={value!r} is neither an existing file nor a Jinja template; pass "
                     "the path of a .jinja file")


def _tiktoken_tokenizer(model_dir: str):
    from transformers import PreTrainedTokenizerFast

    config_path = os.path.join(model_dir, "tokenizer_config.json")
    config = _read_json(config_path) if os.path.isfile(config_path) else {}
    decoder = config.get("added_tokens_decoder") or {}
    try:
        specials = {int(i): _token_content(e) for i, e in decoder.items()}
    except ValueError as e:
        raise ValueError(f"{config_path}: added_tokens_decoder keys must be token ids ({e})") from None
    backend = build_tiktoken_tokenizer(load_tiktoken_ranks(os.path.join(model_dir, TIKTOKEN_FILE)), specials)
    kwargs = {k: _token_content(config[k]) for k in ("bos_token", "eos_token", "pad_token", "unk_token")
              if config.get(k) is not None}
    template = config.get("chat_template")
    jinja = os.path.join(model_dir, "chat_template.jinja")
    if template is None and os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            template = f.read()
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=template, **kwargs)
    if config.get("add_bos_token") and hf.bos_token_id is not None:
        hf.add_bos_token = True
    return hf


def get_tokenizer(model_dir: str, *, trust_remote_code: bool = False, chat_template: str | None = None) -> Tokenizer:
    """The tokenizer of a local directory (see the module docstring)."""
    if model_dir is None:
        raise ValueError("get_tokenizer needs a directory, got None; pass --tokenizer <dir> or --model <dir>")
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise ValueError(f"tokenizer directory {model_dir!r} does not exist; pass --tokenizer <dir>")
    has_json = os.path.isfile(os.path.join(model_dir, "tokenizer.json"))
    has_tiktoken = os.path.isfile(os.path.join(model_dir, TIKTOKEN_FILE))
    config_path = os.path.join(model_dir, "tokenizer_config.json")
    if not (has_json or has_tiktoken or os.path.isfile(config_path)):
        raise ValueError(f"no tokenizer in {model_dir!r}: expected tokenizer.json, tiktoken.model or "
                         "tokenizer_config.json (write_tiny_models() writes one); pass --tokenizer <dir>")
    tok_config = _read_json(config_path) if os.path.isfile(config_path) else {}  # corrupt: named here
    if has_tiktoken and not has_json:
        hf = _tiktoken_tokenizer(model_dir)
    else:
        from transformers import AutoTokenizer, PretrainedConfig
        kwargs = {}
        if tok_config.get("tokenizer_class"):
            # The class is named: transformers need not parse the model's config.json (which it
            # validates strictly, e.g. refusing a V3 config whose n_routed_experts is null).
            kwargs["config"] = PretrainedConfig()
        try:
            hf = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=trust_remote_code,
                                               **kwargs)
        except ValueError as e:
            text = " ".join(str(e).split())
            if "trust_remote_code" in text and not trust_remote_code:
                raise ValueError(f"the tokenizer in {model_dir!r} runs its own code; pass --trust-remote-code "
                                 "(trust_remote_code=True) if you trust it") from None
            raise ValueError(f"cannot load the tokenizer in {model_dir!r}: {text}") from None
        except OSError as e:
            raise ValueError(f"cannot load the tokenizer in {model_dir!r}: {' '.join(str(e).split())}") from None
    override = load_chat_template(chat_template)
    if override is not None:
        hf.chat_template = override
    return Tokenizer(hf, model_dir)


def get_tokenizer_for(model_config) -> Tokenizer:
    """The tokenizer a ModelConfig asks for: --tokenizer (else the model directory),
    --trust-remote-code and --chat-template honoured."""
    return get_tokenizer(model_config.tokenizer_path,
                         trust_remote_code=bool(getattr(model_config, "trust_remote_code", False)),
                         chat_template=getattr(model_config, "chat_template", None))
