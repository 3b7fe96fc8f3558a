"""Per-row sampling settings for one batch, built from each request's SamplingParams.

Random sampling draws from a per-request `torch.Generator` so that every TP/DCP rank, which runs the
same sampler on the same logits, draws the same numbers and therefore picks the same tokens. The
generator must live as long as the request (its state advances every step); `RequestGenerators`
keeps them for the model runner.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# Temperatures below this are treated as greedy (argmax); dividing by them would overflow.
SAMPLING_EPS = 1e-5


def is_greedy(params) -> bool:
    return params is None or float(getattr(params, "temperature", 1.0)) < SAMPLING_EPS


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return generator


def resolve_request_seed(params, engine_seed: int, request_index: int) -> int:
    """The request's own seed, else `engine_seed + request_index` (same on every rank)."""
    seed = getattr(params, "seed", None)
    return int(seed) if seed is not None else int(engine_seed) + int(request_index)


@dataclass
class SamplingMetadata:
    """Rows are requests (not tokens).

    temperature: [num_reqs] float32, 0 for greedy rows.
    top_k: [num_reqs] int64 with 0 meaning "off", or None when no row uses it.
    top_p: [num_reqs] float32 with 1.0 meaning "off", or None when no row uses it.
    generators: row index -> generator for random rows that have one (others use the global RNG).
    """

    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    generators: dict[int, torch.Generator] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return int(self.temperature.shape[0])

    @classmethod
    def from_sampling_params(
        cls,
        params: Sequence,
        device: torch.device | str,
        generators: dict[int, torch.Generator] | Sequence[torch.Generator | None] | None = None,
    ) -> SamplingMetadata:
        """Build from one SamplingParams (or None = greedy) per row."""
        greedy = [is_greedy(p) for p in params]
        temps = [0.0 if g else float(p.temperature) for g, p in zip(greedy, params)]
        top_ks = [_top_k_of(p) for p in params]
        top_ps = [_top_p_of(p) for p in params]
        if generators is None:
            gens: dict[int, torch.Generator] = {}
        elif isinstance(generators, dict):
            gens = dict(generators)
        else:
            gens = {i: g for i, g in enumerate(generators) if g is not None}
        # Greedy rows never draw: dropping their generators keeps the state of those untouched.
        gens = {i: g for i, g in gens.items() if not greedy[i]}
        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_k=torch.tensor(top_ks, dtype=torch.int64, device=device) if any(top_ks) else None,
            top_p=(torch.tensor(top_ps, dtype=torch.float32, device=device)
                   if any(p < 1.0 for p in top_ps) else None),
            generators=gens,
        )


def _top_k_of(params) -> int:
    # Upstream has used both 0 and -1 for "off"; accept either.
    k = int(getattr(params, "top_k", 0) or 0) if params is not None else 0
    return max(k, 0)


def _top_p_of(params) -> float:
    p = float(getattr(params, "top_p", 1.0)) if params is not None else 1.0
    return p


class RequestGenerators:
    """The runner-side store of per-request generators (created on first sight, dropped on finish).

    Every rank creates the generator from the same seed, so all ranks sample identically.
    """

    def __init__(self, device: torch.device | str, engine_seed: int = 0):
        self.device = torch.device(device)
        self.engine_seed = engine_seed
        self._num_added = 0
        self._generators: dict[str, torch.Generator] = {}

    def add_request(self, req_id: str, params) -> None:
        if req_id in self._generators or is_greedy(params):
            self._num_added += 1
            return
        seed = resolve_request_seed(params, self.engine_seed, self._num_added)
        self._num_added += 1
        self._generators[req_id] = make_generator(seed, self.device)

    def remove_request(self, req_id: str) -> None:
        self._generators.pop(req_id, None)

    def get(self, req_id: str) -> torch.Generator | None:
        return self._generators.get(req_id)

    def for_batch(self, req_ids: Sequence[str]) -> dict[int, torch.Generator]:
        return {i: self._generators[r] for i, r in enumerate(req_ids) if r in self._generators}
