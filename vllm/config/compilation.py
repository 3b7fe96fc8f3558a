"""CompilationConfig: CUDA-graph capture of uniform decode / verify steps (vLLM's FULL_DECODE_ONLY).

Only uniform decode batches (every row Q = 1 + num_speculative_tokens) are captured; they are padded
to the next capture size with trailing zero-length rows. Mixed prefill steps always run eager.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.config._checks import check_positive_int


def default_capture_sizes(max_size: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to `max_size` (upstream's default shape)."""
    sizes = [s for s in (1, 2, 4) if s <= max_size]
    sizes += list(range(8, max_size + 1, 8))
    if not sizes or sizes[-1] != max_size:
        sizes.append(max_size)
    return sorted(set(sizes))


@dataclass
class CompilationConfig:
    # Batch sizes (requests) captured; None = default_capture_sizes(max_cudagraph_capture_size).
    cudagraph_capture_sizes: list[int] | None = None
    # Largest captured batch; None = max_num_seqs (resolved by VllmConfig).
    max_cudagraph_capture_size: int | None = None
    _resolved: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self):
        check_positive_int("max_cudagraph_capture_size", self.max_cudagraph_capture_size,
                           optional=True)
        sizes = self.cudagraph_capture_sizes
        if sizes is not None:
            if (not isinstance(sizes, (list, tuple)) or not sizes
                    or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes)):
                raise ValueError(f"cudagraph_capture_sizes={sizes!r} is invalid: give a non-empty "
                                 "list of ints >= 1, e.g. [1, 2, 4, 8].")
            self.cudagraph_capture_sizes = sorted(set(int(s) for s in sizes))

    def resolve(self, max_num_seqs: int) -> list[int]:
        """The capture sizes in force (ascending), none above max_num_seqs."""
        if self.cudagraph_capture_sizes is not None:
            sizes = list(self.cudagraph_capture_sizes)
            if self.max_cudagraph_capture_size is not None:
                sizes = [s for s in sizes if s <= self.max_cudagraph_capture_size]
        else:
            top = min(self.max_cudagraph_capture_size or max_num_seqs, max_num_seqs)
            sizes = default_capture_sizes(top)
        sizes = [s for s in sizes if s <= max_num_seqs]
        if not sizes:
            raise ValueError(
                f"no CUDA-graph capture size is <= max_num_seqs={max_num_seqs} "
                f"(cudagraph_capture_sizes={self.cudagraph_capture_sizes}, "
                f"max_cudagraph_capture_size={self.max_cudagraph_capture_size}); "
                "raise them or pass --enforce-eager.")
        self._resolved = sizes
        return sizes

    @classmethod
    def from_any(cls, value) -> "CompilationConfig":
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            import json
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"compilation_config is not valid JSON: {e.msg}; expected e.g. "
                                 '\'{"cudagraph_capture_sizes": [1, 2, 4, 8]}\'.') from None
        if not isinstance(value, dict):
            raise ValueError(f"compilation_config={value!r} is invalid: pass a dict or JSON.")
        known = ("cudagraph_capture_sizes", "max_cudagraph_capture_size")
        unknown = [k for k in value if k not in known]
        if unknown:
            raise ValueError(f"compilation_config has unsupported key(s) {unknown}: this engine "
                             f"honours only {list(known)}.")
        return cls(**value)
