"""Synthetic prompts for the benchmarks (no dataset downloads)."""
from __future__ import annotations

import random


def random_token_prompts(tokenizer, num_prompts: int, input_len: int, seed: int = 0,
                         vocab_size: int | None = None) -> list[list[int]]:
    """Prompts of exactly `input_len` random token ids, avoiding special tokens (ids that decode
    to nothing when special tokens are skipped)."""
    if input_len < 1:
        raise ValueError(f"--input-len must be >= 1, got {input_len}")
    vocab = vocab_size or len(tokenizer)
    rng = random.Random(seed)
    usable: dict[int, bool] = {}

    def ok(token: int) -> bool:
        if token not in usable:
            usable[token] = tokenizer.decode([token]) != ""
        return usable[token]

    prompts = []
    for _ in range(num_prompts):
        ids = []
        while len(ids) < input_len:
            token = rng.randrange(vocab)
            if ok(token):
                ids.append(token)
        prompts.append(ids)
    return prompts


def random_text_prompts(num_prompts: int, input_len: int, seed: int = 0) -> list[str]:
    """Text prompts of `input_len` characters of random lowercase words (≈ tokens on byte-level
    tokenizers; the server reports the true token count in `usage`)."""
    if input_len < 1:
        raise ValueError(f"--input-len must be >= 1, got {input_len}")
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        text = ""
        while len(text) < input_len:
            word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7)))
            text = f"{text} {word}" if text else word
        prompts.append(text[:input_len])
    return prompts


def spec_bench_prompt(i: int, length: int) -> list[int]:
    """Request i's prompt in the speculative-decoding benchmarks and probes (spec_policy,
    spec_step_kinds, drafter_acceptance, probe_spec_step): `length` byte tokens of a stride-13
    walk mod 200 (20..219), offset by request; deterministic, no tokenizer needed."""
    return [(7 * i + 13 * j) % 200 + 20 for j in range(length)]
