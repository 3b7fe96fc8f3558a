"""Tokenizer from a model directory's tokenizer.json (the `tokenizers` library; no hub access)."""
from __future__ import annotations

import json
import os
from collections.abc import Sequence

from tokenizers import Tokenizer


def _token_name(entry) -> str | None:
    # tokenizer_config.json stores special tokens either as plain strings or as AddedToken dicts.
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, dict):
        return entry.get("content")
    raise ValueError(f"unrecognised special-token entry {entry!r} in tokenizer_config.json")


class HFTokenizer:
    """Thin wrapper: encode(text) -> ids, decode(ids) -> text, plus the special-token ids."""

    def __init__(self, tokenizer: Tokenizer, tokenizer_config: dict | None = None):
        self._tok = tokenizer
        cfg = tokenizer_config or {}
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        self.bos_token = _token_name(cfg.get("bos_token"))
        self.eos_token = _token_name(cfg.get("eos_token"))
        self.pad_token = _token_name(cfg.get("pad_token"))
        self.bos_token_id = self._id_or_none(self.bos_token)
        self.eos_token_id = self._id_or_none(self.eos_token)
        self.pad_token_id = self._id_or_none(self.pad_token)
        if self.add_bos_token and self.bos_token_id is None:
            raise ValueError("tokenizer_config.json sets add_bos_token but names no bos_token in the vocab")

    def _id_or_none(self, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"special token {token!r} from tokenizer_config.json is not in tokenizer.json")
        return token_id

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self._tok.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def get_tokenizer(model_dir: str) -> HFTokenizer:
    """Load `<model_dir>/tokenizer.json` (+ optional tokenizer_config.json for special tokens)."""
    path = os.path.join(os.fspath(model_dir), "tokenizer.json")
    if not os.path.isfile(path):
        raise ValueError(
            f"no tokenizer.json in {model_dir!r}; the model directory must ship a `tokenizers` "
            "tokenizer.json (write_tiny_models() writes one)"
        )
    config_path = os.path.join(os.fspath(model_dir), "tokenizer_config.json")
    config = None
    if os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    return HFTokenizer(Tokenizer.from_file(path), config)
