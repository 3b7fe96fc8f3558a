"""Kimi-style `tiktoken.model` tokenizers rebuilt with the `tokenizers` library (no tiktoken).

A tiktoken.model file holds one "<base64 token bytes> <rank>" per line. tiktoken's BPE starts from
single bytes and repeatedly merges the adjacent pair whose concatenation has the lowest rank. The
equivalent Hugging Face byte-level BPE has vocab {byte_level(token): rank} and, for every token of
two or more bytes, merges (left, right) over each split into two existing tokens, ordered by the
merged token's rank (then the parts' ranks), which is the order tiktoken applies them.
Pre-tokenisation is tiktoken's split regex (Kimi-K2's `pat_str` by default), then the GPT-2 byte
to unicode map; special tokens come from tokenizer_config.json's `added_tokens_decoder`.
"""
from __future__ import annotations

import base64

# tokenization_kimi.py's pat_str (Kimi-K2): Han runs split apart from other letters. Oniguruma,
# the regex engine of `tokenizers`, supports its class intersections (&&).
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# Kimi reserves this many ids after the BPE ranks for special tokens; unnamed ones are
# <|reserved_token_{id}|>.
NUM_RESERVED_SPECIAL_TOKENS = 256


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the ByteLevel alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def load_tiktoken_ranks(path: str) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            parts = line.split()
            try:
                token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
                if len(parts) != 2:
                    raise ValueError
            except (ValueError, IndexError, base64.binascii.Error):
                raise ValueError(f"{path}:{lineno} is not '<base64 token> <rank>'; is this a tiktoken.model "
                                 "file?") from None
            ranks[token] = rank
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"{path} lacks single-byte tokens for bytes {missing[:8]}...; tiktoken BPE needs all 256")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be 0..{len(ranks) - 1} without gaps or repeats")
    return ranks


def build_tiktoken_tokenizer(ranks: dict[bytes, int], special_tokens: dict[int, str],
                             pat_str: str = KIMI_PAT_STR):
    """A `tokenizers.Tokenizer` equivalent to tiktoken's encoding of `ranks` + specials."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    b2u = byte_to_unicode()

    def text(token: bytes) -> str:
        return "".join(b2u[b] for b in token)

    vocab = {text(t): r for t, r in ranks.items()}
    merges = []
    for token, rank in ranks.items():
        if len(token) < 2:
            continue
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], text(left), text(right)))
    merges.sort()
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(m[3], m[4]) for m in merges], ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pat_str), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    base = len(ranks)
    taken = set(special_tokens)
    clash = [i for i in taken if i < base]
    if clash:
        raise ValueError(f"special token ids {sorted(clash)[:8]} overlap the {base} BPE ranks of tiktoken.model")
    top = max([base + NUM_RESERVED_SPECIAL_TOKENS - 1, *taken]) if taken else base + NUM_RESERVED_SPECIAL_TOKENS - 1
    names = {i: special_tokens.get(i, f"<|reserved_token_{i}|>") for i in range(base, top + 1)}
    # add_special_tokens assigns consecutive ids from the current size: add them in id order
    tok.add_special_tokens([AddedToken(names[i], special=True, normalized=False) for i in sorted(names)])
    for i, name in names.items():
        if tok.token_to_id(name) != i:
            raise ValueError(f"special token {name!r} did not get id {i}; duplicate names in "
                             "added_tokens_decoder?")
    return tok
