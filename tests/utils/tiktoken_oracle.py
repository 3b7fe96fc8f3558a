"""A small self-made tiktoken.model and a brute-force tiktoken encoder (the oracle for
vllm/transformers_utils/tiktoken_bpe.py): split with the pattern (python `regex`), then merge the
adjacent pair whose concatenation has the lowest rank until none is in the vocabulary."""
from __future__ import annotations

import base64
import collections
import os

import regex

CORPUS = ("the quick brown fox jumps over the lazy dog. The dog's bark; they're here, we've seen it. "
          "1234567 numbers 89 and 000. 你好世界，你好朋友。 mixed 中文 and English words\n\nnew line  "
          "spaces\ttab ünïcödé café naïve — emoji 🙂🙂 ok OK Ok oK camelCase HTTPServer")


def train_ranks(corpus: str = CORPUS, num_merges: int = 120) -> dict[bytes, int]:
    """Byte-level BPE ranks: 256 single bytes, then the most frequent adjacent pair each round."""
    ranks = {bytes([b]): b for b in range(256)}
    words = [list(bytes([b]) for b in w.encode()) for w in regex.findall(r"\S+|\s+", corpus)]
    for _ in range(num_merges):
        pairs = collections.Counter()
        for w in words:
            pairs.update(zip(w, w[1:]))
        if not pairs:
            break
        (a, b), _count = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        merged = a + b
        if merged in ranks:
            break
        ranks[merged] = len(ranks)
        new_words = []
        for w in words:
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(merged)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words.append(out)
        words = new_words
    return ranks


def write_tiktoken_model(path: str, ranks: dict[bytes, int]) -> None:
    with open(path, "w", encoding="ascii") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")


def bpe_encode_piece(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    parts = [bytes([b]) for b in piece]
    while len(parts) > 1:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            break
        _, i = best
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return [ranks[p] for p in parts]


def tiktoken_encode(text: str, ranks: dict[bytes, int], pat_str: str, specials: dict[str, int]) -> list[int]:
    """Special tokens are matched first (as tiktoken's encode with allowed_special='all')."""
    pattern = regex.compile(pat_str, flags=regex.V1)
    ids: list[int] = []
    if specials:
        splitter = regex.compile("(" + "|".join(regex.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")")
        chunks = splitter.split(text)
    else:
        chunks = [text]
    for chunk in chunks:
        if chunk in specials:
            ids.append(specials[chunk])
            continue
        for piece in pattern.findall(chunk):
            ids.extend(bpe_encode_piece(piece.encode(), ranks))
    return ids


def write_kimi_style_tokenizer(model_dir: str, ranks: dict[bytes, int], chat_template: str | None = None) -> dict:
    """tiktoken.model + tokenizer_config.json (added_tokens_decoder as Kimi ships it, an auto_map
    naming tokenization_kimi.py); no tokenizer.json. Returns {special: id}."""
    import json

    os.makedirs(model_dir, exist_ok=True)
    write_tiktoken_model(os.path.join(model_dir, "tiktoken.model"), ranks)
    base = len(ranks)
    names = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>"]
    specials = {name: base + i for i, name in enumerate(names)}
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[EOS]",
        "added_tokens_decoder": {str(i): {"content": n, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for n, i in specials.items()},
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return specials
